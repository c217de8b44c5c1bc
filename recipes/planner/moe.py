"""Expert parallelism's all-to-all bytes per link class: what one rank of a pipeline stage sends per training step to
the other ranks of its ep group, split by whether the destination is on its node. Pure arithmetic.

Per MoE layer and micro-batch a rank routes T tokens (micro_batch x seq_len / cp, / tp under sequence parallelism;
without it every tp rank routes all of them) to k experts: R = T k rows of d_model elements. Routing uniform (the
dry run's fake tensors have no values to route by; a balanced router's expectation), the rows split over the ep
ranks as parallel/expert/dispatch.py's even split: R // ep each, the first R % ep ranks one more. Every rank but
this one receives its share straight from it (an all-to-all is no ring): intra-node when the destination's global
rank is on this rank's node (node_size consecutive ranks), else inter-node. Passes per layer and micro-batch: the
dispatch and the combine, each again in backward (4), and under activation checkpointing once more in the
recomputed forward (6). The ep group: ep consecutive grad ranks (dp-major, cp inner) at this rank's (pp, tp),
numbered as parallel/topology.Topology.rank_at numbers the mesh (pp, dp, cp, tp), tp innermost.

Also the activation planner's DeepSeek-V3 terms (recipes/planner/activations.py): an MoE block's routed rows and its
backward moments (moe_activation_terms, moe_workspace), what an MoE or latent-attention block leaves in the
zero-bubble schedules' weight-gradient store (store_terms), and the multi-token prediction modules on the last stage
(mtp_terms).
"""

from __future__ import annotations


def _global_rank(layout, pp: int, grad: int, tp: int = 0) -> int:
    dp, cp = divmod(grad, layout.cp)
    return ((pp * layout.dp + dp) * layout.cp + cp) * layout.tp + tp  # Topology.rank_at's numbering


def routed_rows(cfg, layout) -> int:
    """Rows one rank's MoE layer sends through its all-to-all per micro-batch (before the split over ep)."""
    tokens = layout.micro_batch * layout.seq_len // layout.cp
    if layout.sequence_parallel:
        tokens //= layout.tp
    return tokens * cfg.moe_top_k


def all_to_all_link_bytes(cfg, layout, layers, pp_rank: int, element_bytes: int, grad_rank: int = 0,
                          tp_rank: int = 0) -> dict[str, float]:
    """{"intra": bytes, "inter": bytes} the rank at (pp_rank, grad_rank, tp_rank) sends per step in the all-to-alls
    of the MoE layers among `layers` (its blocks), with `layout.node_size` ranks per node (0: one node)."""
    out = {"intra": 0.0, "inter": 0.0}
    moe = sum(1 for i in layers if cfg.moe_layer(i))
    if layout.ep <= 1 or not moe:
        return out
    ep = layout.ep
    first = grad_rank - grad_rank % ep
    me = _global_rank(layout, pp_rank, grad_rank, tp_rank)
    rows = routed_rows(cfg, layout)
    passes = 6 if layout.checkpointing else 4
    for j in range(ep):
        peer = _global_rank(layout, pp_rank, first + j, tp_rank)
        if peer == me:
            continue
        share = rows // ep + (j < rows % ep)
        same = layout.node_size and peer // layout.node_size == me // layout.node_size
        out["intra" if same or not layout.node_size else "inter"] += \
            passes * moe * layout.grad_accum * share * cfg.d_model * element_bytes
    return out


def moe_activation_terms(cfg, element_bytes: int, param_bytes: int,
                         ep: int = 1) -> tuple[float, float, float, float, float]:
    """What an MoE layer adds to a block's activations (the dense MLP's part is then its shared experts' only), as
    measured on the dry runs' fake steps (recipes/dry_run; the tensors alive at each peak named by the op that made
    them): (bytes kept per routing token, bytes of the routed rows' input gradient per routing token, bytes of the
    local experts' c_fc weight gradient, bytes the combine's backward adds per routing token, bytes the experts'
    SwiGLU backward adds per routing token). A routing token is
    one of this rank's s b / cp positions (/ tp under sequence parallelism: each tp rank routes its own). Kept for
    backward, per token (k = top-k, f = moe_d_ff, e bytes): the rows received by the dispatch all-to-all (the
    grouped matmul's input, k h), the rows received back by the combine's (the expert outputs its weighting needs,
    k h) and the weighted rows cast back (k h); the grouped c_fc's [gate; up] (2 k f), silu(gate) and the product
    (k f each); the router's fp32 input (4 h) and its fp32 logits and two softmaxes (routing, load-balancing
    statistics: 12 E bytes). The backward's heaviest moments: the experts' c_fc backward, its weight gradient of
    all n_experts / ep local experts (2 f h in the parameters' dtype; under sequence parallelism cloned once more
    for its all-reduce over tp) beside the rows' input gradient (k h), the layer's other routed activations freed
    by then; and the combine's backward (models/moe/dispatch.py: the expert outputs times their fp32 routing
    weights, cast back), which holds three fp32 rows a routed row - the gradient cast up, and its products with
    the weights and with the outputs - when the weighted rows' own k h e are gone (DeepSeek-V3's stages peak there:
    2.8 GB at k 8, h 7168, 4,096 tokens); and the experts' SwiGLU backward (models/moe/experts.py, after c_proj's):
    the product's gradient (k f, c_proj's input gradient, the product itself freed with c_proj's saved input),
    d silu and d up (2 k f), c_proj's weight gradient of the local experts (f h: half of c_fc's), the combine's
    received and weighted rows freed by then (- 2 k h): Mixtral's heaviest moment (f = 3.5 h; its recomputed
    layer at mixtral-8x7b-ft's 4,096 tokens holds 1.66 GB of routed rows and expert activations there)."""
    if not cfg.is_moe:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    h, k, f = cfg.d_model, cfg.moe_top_k, cfg.moe_d_ff
    kept = k * (3 * h + 4 * f) * element_bytes + 4 * h + 12 * cfg.n_experts
    return (float(kept), float(k * h * element_bytes), float(cfg.n_experts // ep * 2 * f * h * param_bytes),
            float(k * h * (3 * 4 - element_bytes)), float(2 * k * (f - h) * element_bytes))


def moe_workspace(spec, s: int, b: int, t: int, sequence_parallel: bool) -> list[float]:
    """An MoE block's backward moments beyond its saved activations (moe_activation_terms): the experts' c_fc
    backward (its weight gradient, under sequence parallelism its clone for the all-reduce over tp, and the rows'
    input gradient, the routed activations freed), the combine's backward and the experts' SwiGLU backward
    (c_proj's weight gradient: half c_fc's elements)."""
    routing = s * b / (t if sequence_parallel else 1)
    copies = 2 if sequence_parallel and t > 1 else 1
    experts = copies * spec.moe_weight_grad_bytes + routing * (spec.moe_rows_grad_bytes - spec.moe_token_bytes)
    swiglu = spec.moe_weight_grad_bytes / 2 + routing * spec.moe_swiglu_bytes
    return [experts, routing * spec.moe_combine_bytes, swiglu]


def input_pass(specs: dict, kinds: list, s: int, b: int, h: int, t: int, sequence_parallel: bool) -> float:
    """The heaviest moment of a split backward's input-gradient pass (B) through a block of one of `kinds` (0.0 for
    none), beyond its saved activations: its MLP's gradient temporaries as its backward starts (mlp_elements h / t
    per token), or an MoE block's own moments (moe_workspace: DeepSeek-V3's last stage under zb_h1 peaks in the
    combine's, 2.35 GB of fp32 rows, while the loss's backward and the waiting micro-batches' stores are held)."""
    moments = [0.0]
    for m in kinds:
        moments.append(specs[m].mlp_elements * specs[m].element_bytes * s * b * h / t)
        if specs[m].moe_token_bytes:
            moments += moe_workspace(specs[m], s, b, t, sequence_parallel)
    return max(moments)


def store_terms(cfg, spec, s: int, b: int, t: int, sequence_parallel: bool, moe: bool) -> float:
    """Bytes a block of kind `moe` keeps from its split backward's B to its W (parallel/pipeline/split_backward.py)
    beyond activations.weight_gradient_inputs, which counts plain heads (QKV and the output projection, h wide)
    and a dense MLP (an MoE block's: its shared experts'). Latent attention (models/deepseek/mla.py) stashes X and
    dY of its own linears instead: q_a (h -> q_lora) and kv_a (h -> r + rope) on this rank's positions (s / tp
    under sequence parallelism), q_b (q_lora -> n qk / t; without q_lora c_q, h -> n qk / t, which under sequence
    parallelism gathers inside its backward: its weight gradient), kv_b (r -> n (nope + v) / t) and the output
    projection (n v / t -> h) on the whole sequence. An MoE block adds its router's matmul (fp32 x, h, and dY, E,
    per routing token) and the experts' weight gradients: the grouped matmul is no F.linear matmul, so B computes
    them (eager edges, c_fc's and c_proj's of the local experts, in the compute dtype: 3 f h n_local); without
    shared experts the dense formula's MLP linears do not exist (its x / dY of width h). Plain heads at their own
    widths: grouped-query K and V (n_kv_head), n_head head_dim != h (Qwen3)."""
    e, h, split = spec.element_bytes, cfg.d_model, t if sequence_parallel else 1
    grad_bytes = 4 if spec.weight_copies else e
    full, local = s * b * e, s * b * e / split
    delta = 0.0
    if cfg.mla:
        n, qk, v = cfg.n_head, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        r, rope, q_lora = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank
        plain = full * (h / t + h) + (grad_bytes * 3 * h * h / t if sequence_parallel else full * (h + 3 * h / t))
        latent = local * (h + r + rope) + full * (r + n * (cfg.qk_nope_head_dim + v) / t) + full * (n * v / t + h)
        if q_lora:
            latent += local * (h + q_lora) + full * (q_lora + n * qk / t)
        else:
            latent += grad_bytes * h * n * qk / t if sequence_parallel else full * (h + n * qk / t)
        delta += latent - plain
    elif cfg.n_kv_head * cfg.head_dim != cfg.d_model or cfg.n_head * cfg.head_dim != cfg.d_model:
        # grouped-query heads (K and V n_kv_head wide) or heads not d_model wide: QKV's dY (or its weight gradient
        # under sequence parallelism) and the output projection's x at their own widths
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        qkv = grad_bytes * h * (q + 2 * kv - 3 * h) / t if sequence_parallel else full * (q + 2 * kv - 3 * h) / t
        delta += qkv + full * (q - h) / t
    if moe and spec.moe_token_bytes:
        param_bytes = spec.residual  # moe_weight_grad_bytes' dtype: 4 under autocast of fp32 parameters, else e
        delta += s * b / split * 4 * (h + cfg.n_experts) + 1.5 * spec.moe_weight_grad_bytes * e / param_bytes
        if not cfg.moe_shared_experts:
            delta -= full * (1 if sequence_parallel else 2) * h
    return delta


def mtp_terms(cfg, spec, full: dict, heavy: dict, sbh: float, split: int, logits: float, head_grad: float,
              checkpointing: bool) -> tuple[float, float, list[bool]]:
    """DeepSeek-V3's multi-token prediction on the last stage (models/deepseek/mtp.py), per micro-batch, measured on
    the dry run of deepseek-v3's last stage (tests/recipes/planner/test_deepseek_dry_run.py): (bytes its depths
    keep from forward to backward, its heaviest backward moment beyond what the stage holds, the kinds of its
    blocks, moe or not). `full` / `heavy`: a block's stored bytes and its backward at its heaviest (recomputed
    under checkpointing) by kind; `logits`: one head's logits as kept (e bytes, its fp32 copy below fp32 without
    the fused cross-entropy); `head_grad`: the head's weight gradient (V / tp x h, e bytes).
    Kept per depth: the embedding of its shifted tokens (e s b h), its output (the final norm's input, r) and the
    head's input (e), the logits; without checkpointing also its block's activations and the norms' outputs
    concatenated with the projection's output (3 e s b h). Under checkpointing each depth is recomputed as a block
    (keeping its two inputs). Its backward's heaviest moment is its block's, after its own head's: that head's
    input and logits are freed, its weight gradient is held until the main head's adds to it (the head is used
    twice), and the recomputed norms and projection (3 e s b h) are alive beside the block's."""
    e, r = spec.element_bytes, spec.residual
    kinds = [bool(spec.moe_token_bytes) and cfg.moe_layer(cfg.n_layer + k) for k in range(cfg.mtp_depth)]
    own = (e + r) * sbh / split + e * sbh + logits  # the head's input gathered under sequence parallelism
    kept = sum(own + (0.0 if checkpointing else full[m] + 3 * e * sbh / split) for m in kinds)
    moment = max((heavy[m] + (3 * e * sbh / split if checkpointing else 0.0) + head_grad - own + e * sbh / split
                  for m in kinds), default=0.0)
    return kept, moment, kinds
