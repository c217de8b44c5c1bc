"""Activation memory per device of a GPT under (tp, pp), with and without activation checkpointing.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4: one transformer
layer of sequence s, micro-batch b, hidden h, a heads stores, with 16-bit activations and 1-byte dropout masks,

    no parallelism            s b h (34 + 5 a s / h)               bytes
    tensor parallel t         s b h (10 + 24 / t + 5 a s / (h t))  (LayerNorm/dropout inputs stay replicated)
    full recomputation        2 s b h                              (only the layer's input is kept)

Itemised (so other element sizes follow; e = bytes per activation element, m = bytes per dropout mask element,
r = bytes per element of the residual stream):
    replicated over tp:  the inputs of the 2 LayerNorms (2r) and of QKV / fc1 (2e) + 2 residual dropout masks (2m)
    sharded over tp:     Q, K, V (3e), the attention output projection input (e), the GELU input (4e), fc2 input (4e);
                         SwiGLU: [gate; up] (2 d_ff / h e), silu(gate) and c_proj's input (d_ff / h e each);
                         grouped-query K / V are kept repeated to every query head (what the kernel receives)
    attention scores:    a s^2 b (softmax output e + dropout mask m + dropout output e), sharded over tp; with
                         fused (flash / SDPA) attention no scores are stored, only the fp32 log-sum-exp
                         (4 a s b; its output is laid out as the projection's input, so it is counted once).
At r = e = 2, m = 1 this is exactly the paper's 34 and 5. CUDA's fused dropout keeps a 1-byte mask; on the CPU
torch keeps the mask in the dtype of the dropout's input (m = r). Without dropout (p = 0) there is no mask and no
dropout output.

torch AMP (ZeRO-0 in bf16/fp16: fp32 parameters under autocast, recipes/training/model_setup.py): the residual
stream is fp32 (r = 4; LayerNorm inputs and full recomputation's checkpoints: 4 s b h per block at megatron-8.3b's
width, tp 8, measured), the matmuls run on 16-bit casts (e = 2) and keep their weights' casts for backward, 12 h^2
/ t elements of e bytes per block and micro-batch in flight unless the block is recomputed (`weight_copies`).

Outside the blocks: the embedding dropout mask (first stage); on the last stage the final LayerNorm's and the
head's inputs ((r + e) s b h; under autocast also the head weight's cast, e V h / t) and the logits, s b V/t
elements plus, below fp32 with the reference cross-entropy only, an fp32 copy (the paper's 4 s b v / t; the fused
kernels promote a chunk of rows at a time, two in flight, and keep three fp32 numbers per row: `fused_ce`). With
checkpointing one layer's full activations exist again while it is recomputed in backward.

Pipeline: what a rank holds at its peak comes from walking its schedule's own action list
(recipes/planner/schedule_memory.py), chunk by chunk: under 1F1B, stage i holds min(pp - i, micro-batches)
micro-batches in flight (stage 0 holds pp, the paper's sec. 4.2.3); GPipe every micro-batch; the interleaved
schedule pp (1 + (pp - 1) / (pp v)) on stage 0 (the paper's factor); ZB-H1 pp on every rank, ZBV and DualPipeV
their two half chunks as the lists hold them. A non-last stage also keeps its output until its backward (s b h,
r bytes). Zero-bubble schedules split the backward (parallel/pipeline/split_backward.py): B releases the graph
and a micro-batch keeps, until its W, only what its weight gradients need - every linear's input and output
gradient (per block x: 2 h + h / t + d_ff / t, dY: 3 h / t (grouped-query: an upper bound) + 2 h + the MLP
input matmul's mlp_elements / 2 h / t, e bytes; under sequence parallelism QKV's and fc1's parameter-sized dW
instead of their x and dY); on the last stage the head's weight gradient (V/t h, e bytes; at very few tokens
its input and d logits, when smaller: split_backward's choice). The first stage's W is its whole
backward, and under activation checkpointing W re-traverses the graph: both keep the graph and the gradient
that arrived. During a backward one block's gradient temporaries (the MLP's, mlp_elements h / t, e bytes) and
on the last stage d logits come on top (`workspace_bytes`). The planner takes the stage with the most memory.

FP8 (train.fp8) keeps the plain linears' activations (under autocast of fp32 parameters no 16-bit weight cast, and
the QKV / fc1 inputs at the residual's bytes); its own memory is transient (planner/links.py's fp8_workspace).
An MoE model's blocks and its MTP modules: planner/moe.py (ActivationSpec.block, moe_workspace, mtp_terms).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from megazoo.models.config import ModelConfig
from megazoo.parallel.pipeline.partition import rank_chunks, uniform_stage_layers
from megazoo.parallel.pipeline.schedules import SPLIT_BACKWARD
from megazoo.parallel.pipeline.schedules import placement as placement_of
from megazoo.recipes.planner.links import FP8_CHUNK_ELEMENTS, fp8_workspace  # noqa: F401 (the tests read them here)
from megazoo.recipes.planner.moe import moe_activation_terms, moe_workspace, mtp_terms, store_terms, input_pass
from megazoo.recipes.planner.schedule_memory import ChunkBytes, peak_live, rank_peak
from megazoo.recipes.planner.zero import PlanError

# kernels/cross_entropy.py's CHUNK_ELEMENTS (not imported: that module loads torch; a test holds the two equal)
CE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ActivationSpec:
    """How activations are stored: element bytes, dropout mask bytes, which attention kernel."""
    element_bytes: int = 2  # fp16 / bf16 activations (4 for fp32 training)
    mask_bytes: int = 1  # CUDA fused dropout: a 1-byte mask; torch on CPU: element_bytes
    flash_attention: bool = False  # fused attention (SDPA / flash): no (b, a, s, s) scores are stored
    dropout: bool = True  # residual / embedding dropout active (p > 0)
    attn_dropout: bool = True  # attention-probability dropout active (p > 0)
    residual_bytes: int = 0  # the residual stream's element (0: element_bytes; 4 under autocast of fp32 params)
    weight_copies: bool = False  # autocast of fp32 parameters: every matmul keeps its weight's 16-bit cast
    mlp_elements: float = 8.0  # MLP activations per token, in units of h (GELU: 2 d_ff / h; SwiGLU: 4 d_ff / h)
    block_weights: float = 12.0  # matmul weight elements of one block, in units of h^2 (weight_copies)
    mlp_hidden: float = 4.0  # d_ff / h: the MLP output projection's input per token, in units of h
    # Packed rows (SFT, models/packing.py): fused kernels per example, so without attention dropout no scores and
    # no (s x s) mask; with dropout SDPA's math path keeps each example's n^2 scores (the unpacked formula bounds
    # it). The per-example path (32-bit, or dropout) keeps each output beside their concatenation: + s b h e / t
    packed: bool = False
    # The cross-entropy: fused (kernels/cross_entropy.py, training's `auto`) keeps the logits and three fp32 numbers
    # per row; False: the reference's fp32 copy of the whole shard (the paper's).
    fused_ce: bool = False
    # Attention per token, in units of h: tp-sharded (Q, K, V and the output projection's input: 4), and
    # replicated over tp (latent attention's down-projection outputs and its gathered latents: 0 otherwise).
    attention_elements: float = 4.0
    latent_elements: float = 0.0
    # An MoE model's blocks (planner/moe.py moe_activation_terms; mlp_elements the shared experts'): bytes kept and
    # the rows' input gradient per routing token, the local experts' c_fc weight gradient, the combine's and the
    # experts' SwiGLU backward per routing token. Its dense blocks (DeepSeek's first k): dense_mlp_*, `block(False)`.
    moe_token_bytes: float = 0.0
    moe_rows_grad_bytes: float = 0.0
    moe_weight_grad_bytes: float = 0.0
    moe_combine_bytes: float = 0.0
    moe_swiglu_bytes: float = 0.0
    fp8: str = "none"  # train.fp8: the blocks' attention and MLP projections in FP8 (fp8_workspace)
    dense_mlp_elements: float = 0.0
    dense_mlp_hidden: float = 0.0

    @property
    def residual(self) -> int:
        return self.residual_bytes or self.element_bytes

    def block(self, moe: bool) -> "ActivationSpec":
        """The spec of one block: an MoE block's (self), or a dense block's of an MoE model (its MLP, no routing)."""
        if moe or not self.moe_token_bytes:
            return self
        return replace(self, mlp_elements=self.dense_mlp_elements, mlp_hidden=self.dense_mlp_hidden,
                       **{f.name: 0.0 for f in fields(self) if f.name.startswith("moe_")})

    @staticmethod
    def for_model(cfg: ModelConfig, element_bytes: int = 2, mask_bytes: int = 1, flash_attention: bool = False,
                  *, autocast_fp32_params: bool = False, packed: bool = False,
                  fused_ce: bool = False, ep: int = 1, fp8: str = "none") -> "ActivationSpec":
        """`autocast_fp32_params`: 16-bit compute under torch autocast of fp32 parameters (megazoo's ZeRO-0 in
        bf16 / fp16): the residual stream is fp32 and the matmuls keep 16-bit copies of their weights. `ep`: the
        expert-parallel degree (each rank's experts: n_experts / ep)."""
        from megazoo.models.flops import block_matmul_params

        amp = autocast_fp32_params and element_bytes < 4
        h = cfg.d_model
        # GELU keeps its input and fc2's (d_ff each); SwiGLU keeps [gate; up] (2 d_ff), silu(gate) and the
        # product that is c_proj's input (d_ff each). At GPT-2's d_ff = 4h: 8, the paper's GELU + fc2 terms.
        mlp = (4 if cfg.mlp == "swiglu" else 2) * cfg.d_ff / h
        hidden, moe, dense = cfg.d_ff / h, (0.0,) * 5, (0.0, 0.0)
        if cfg.is_moe:  # an MoE block's MLP is its shared experts'; dense blocks keep theirs (`block(False)`)
            dense = (0.0, 0.0) if all(map(cfg.moe_layer, range(cfg.n_layer))) else (mlp, hidden)
            hidden = cfg.moe_shared_experts * cfg.moe_shared_d_ff / h
            mlp = 4 * hidden
            moe = moe_activation_terms(cfg, element_bytes, 4 if amp else element_bytes, ep)
        attention, latent = 4.0, 0.0
        if cfg.mla:  # models/deepseek/mla.py: q, k, v at the padded width (and a fused kernel's output: the
            # projection's input is its copy, sliced to v), the projection's input (n v), the down-projections'
            # outputs and the gathered latents (q_lora + r + rope each)
            width = max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
            attention = cfg.n_head * ((4 if flash_attention else 3) * width + cfg.v_head_dim) / h
            latent = 2 * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim) / h
        copies = amp and fp8 == "none"  # FP8 linears run outside autocast: no 16-bit weight casts
        return ActivationSpec(element_bytes, mask_bytes, flash_attention, cfg.dropout > 0, cfg.attn_dropout > 0,
                              4 if amp else 0, copies, mlp, block_matmul_params(cfg) / (h * h), hidden,
                              packed, fused_ce, attention, latent, *moe, fp8, *dense)


def layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, spec: ActivationSpec = ActivationSpec(),
                cp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes one transformer layer stores for backward on one tp rank (Korthikanti et al. 2022, eq. 1-2).
    Context parallelism (cp > 1): `s` is this rank's share of the sequence (s / cp tokens); the attention scores
    are a / cp heads over the whole sequence (all-to-all) - a s (s cp) b / t, an upper bound for the ring, which
    keeps only the log-sum-exp. Sequence parallelism (the paper's eq. 4, s b h (34 / t + 5 a s / (h t))): the
    norm inputs and dropout masks are this rank's s / tp positions, and so are the QKV / fc1 inputs, which
    parallel/tensor/sequence.py keeps as the norm's output shard (r bytes: fp32 under autocast) and all-gathers
    again in backward."""
    e = spec.element_bytes
    m_drop = spec.mask_bytes if spec.dropout else 0
    replicated = 2 * spec.residual + 2 * (spec.residual if spec.fp8 != "none" else e) + 2 * m_drop
    if sequence_parallel:
        replicated = (4 * spec.residual + 2 * m_drop) / t
    # Q, K, V (as the attention kernel keeps them: grouped-query K / V repeated to every query head), the output
    # projection's input, and the MLP's.
    sharded = (spec.attention_elements + spec.mlp_elements) * e
    replicated += spec.latent_elements * e
    sbh = s * b * h
    weights = e * spec.block_weights * h * h / t if spec.weight_copies else 0.0  # the matmul weights' 16-bit casts
    if spec.flash_attention or (spec.packed and not spec.attn_dropout):
        scores = 4 * a * s * b / t  # its fp32 log-sum-exp (its output is the projection input, counted above)
    else:
        per_score = e + ((spec.mask_bytes + e) if spec.attn_dropout else 0)
        scores = per_score * a * s * (s * cp) * b / t
    if spec.packed and (spec.element_bytes != 2 or spec.attn_dropout):
        sharded += e  # the per-example outputs SDPA keeps, beside their concatenation
    routing = s * b / (t if sequence_parallel else 1)  # the tokens this rank routes (experts at expert-tp 1)
    return sbh * (replicated + sharded / t) + scores + weights + routing * spec.moe_token_bytes


def korthikanti(s: int, b: int, h: int, a: int, t: int = 1) -> float:
    """The paper's closed form, 16-bit activations with dropout: s b h (10 + 24/t + 5 a s / (h t))."""
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def checkpoint_bytes(s: int, b: int, h: int, spec: ActivationSpec = ActivationSpec()) -> float:
    """Full recomputation keeps each layer's input only: r s b h, the residual stream's bytes (2 s b h at 16
    bits, 4 under autocast of fp32 parameters), replicated over tp."""
    return spec.residual * s * b * h


def in_flight(schedule: str, pp: int, rank: int, micro_batches: int, virtual: int = 1) -> float:
    """Micro-batches stage `rank` holds at its peak, in whole stages (v chunks of one count 1): schedule_memory.walk."""
    return peak_live(schedule, micro_batches, pp, rank, virtual) / virtual


def weight_gradient_inputs(s: int, b: int, h: int, t: int = 1, spec: ActivationSpec = ActivationSpec(),
                           sequence_parallel: bool = False) -> float:
    """Bytes one block keeps from its split backward's B to its W: split_backward.py's store, each linear's
    input x and output gradient dY (e bytes; the norms' and biases' d-sized gradients are left out). QKV: x h,
    dY 3 h / t; attention projection: x h / t, dY h; MLP input matmul: x h, dY mlp_elements / 2 h / t (GELU
    d_ff, SwiGLU [gate; up] 2 d_ff); MLP output projection: x d_ff / t, dY h. Under sequence parallelism QKV
    and the MLP input matmul gather their input inside their own backward (parallel/tensor/sequence.py), so the
    store keeps their parameter-sized weight gradients instead (in the parameters' dtype)."""
    e = spec.element_bytes
    fc_out = spec.mlp_elements / 2  # (GELU: d_ff / h; SwiGLU: 2 d_ff / h)
    rows = (h / t + h) + (spec.mlp_hidden * h / t + h)  # the two row-parallel projections: x and dY
    if not sequence_parallel:
        return s * b * e * (rows + (h + 3 * h / t) + (h + fc_out * h / t))
    grad_bytes = 4 if spec.weight_copies else e
    return s * b * e * rows + grad_bytes * (3 + fc_out) * h * h / t


def block_workspace(s: int, b: int, h: int, t: int = 1, spec: ActivationSpec = ActivationSpec(),
                    sequence_parallel: bool = False) -> float:
    """Bytes one block's backward holds beyond its saved activations, at the heavier of two moments: the start
    of the MLP's backward (its gradient temporaries, mlp_elements h / t per token), and the backward of the MLP's
    input projection c_fc (measured on the 405B recipe's dry run: the heaviest moment there), which holds the
    gradient of its output (mlp_elements / 2 h / t: SwiGLU's d gate, d up), the gradient of its input before the
    reduce-scatter / all-reduce (h), under sequence parallelism the input all-gathered again for dW (h), and dW
    itself (mlp_elements / 2 h^2 / t in the parameters' dtype, before it is accumulated or copied into a ZeRO
    bucket), while the MLP's saved activations are freed by then (- mlp_elements h / t)."""
    e, mlp_in = spec.element_bytes, spec.mlp_elements / 2
    start = spec.mlp_elements * e * s * b * h / t
    c_fc = (e * s * b * h * (mlp_in / t + 1 + (1 if sequence_parallel else 0)) + spec.residual * mlp_in * h * h / t
            - start)
    heaviest = [start, c_fc]
    if spec.moe_token_bytes:  # an MoE layer's own moments (recipes/planner/moe.py)
        heaviest += moe_workspace(spec, s, b, t, sequence_parallel)
    if spec.fp8 == "none":
        return max(heaviest)
    m, ew = s * b, spec.residual  # tokens; the weight gradients' dtype (the parameters')
    gathered = e * m * h if sequence_parallel else 0.0  # x all-gathered again for dW
    out_fc, in_proj = mlp_in * h / t, spec.mlp_hidden * h / t  # c_fc's output width, c_proj's input width
    moments = [  # each linear's own bytes on top of what the block holds at that point (module docstring)
        e * m * h + fp8_workspace(m, h, in_proj, e, ew, spec.fp8),  # MLP c_proj's backward: its dy + its own
        e * m * h + fp8_workspace(m, h, h / t, e, ew, spec.fp8) - start,  # attention's projection (MLP freed)
        e * m * out_fc + gathered + fp8_workspace(m, out_fc, h, e, ew, spec.fp8) - start,  # c_fc (MLP freed)
        fp8_workspace(m, in_proj, h, e, ew, spec.fp8, forward=True),  # the forward's: c_fc, then c_proj
        fp8_workspace(m, h, in_proj, e, ew, spec.fp8, forward=True)]
    return max(*heaviest, *moments)


@dataclass(frozen=True)
class StageActivations:
    rank: int
    layers: int
    in_flight: float  # micro-batches alive at the peak, in whole stages (v chunks of one count 1)
    layer_bytes: float  # per layer, per micro-batch, as stored (checkpointed: the input only)
    recompute_bytes: float  # one layer's full activations during recomputation (0 without checkpointing)
    extra_bytes: float  # embedding dropout mask / final LayerNorm and logits / stage output, per micro-batch
    held_bytes: float | None = None  # the schedule walk's peak (schedule_memory.walk); None: the in_flight product
    waiting_bytes: float = 0.0  # of held_bytes: what micro-batches between B and W hold beyond their activations
    workspace_bytes: float = 0.0  # a running backward's temporaries on top, at the walk's peak

    @property
    def total_bytes(self) -> float:
        """Activations held at the peak (+ one layer recomputed under checkpointing)."""
        held = self.in_flight * (self.layers * self.layer_bytes + self.extra_bytes) if self.held_bytes is None \
            else self.held_bytes
        return held + self.recompute_bytes

    @property
    def peak_bytes(self) -> float:
        """The device's activation peak: what is held plus the backward's temporaries at that moment."""
        return self.total_bytes + self.workspace_bytes


def stage_activations(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, stage_layers: list[int],
                      *, checkpointing: bool = False, micro_batches: int = 1, schedule: str = "1f1b",
                      virtual: int = 1, spec: ActivationSpec | None = None, head_trained: bool = True,
                      vocab: int | None = None, cp: int = 1, sequence_parallel: bool = False,
                      chunk_layers: list[int] | None = None, fused_loss: bool = False) -> list[StageActivations]:
    """Activation bytes of every pipeline stage (`stage_layers`: blocks per pp rank; `chunk_layers`: blocks per
    virtual stage in pipeline order, default an even split) on one tp rank; with context parallelism `cp`, on
    one cp rank (seq_len / cp tokens of every sequence). `sequence_parallel`: the layers' norm regions and
    checkpointed inputs, and the final norm's input, are s / tp long. Each rank's peak walks its action list
    (schedule_memory.py), every chunk with its own blocks, embedding and head. `fused_loss`
    (parallel/tensor/linear_cross_entropy.py): the last stage keeps dh and dW (e bytes) in place of the logits,
    their fp32 copy, the head's input and its weight's cast; forward's chunk of logits and fp32 dW are transient.
    `head_trained` False (LoRA: the base frozen): the head's backward makes no weight gradient."""
    spec = spec or ActivationSpec.for_model(cfg)
    s, b, h, a, e = seq_len // cp, micro_batch, cfg.d_model, cfg.n_head, spec.element_bytes
    vocab = vocab or cfg.padded_vocab(tp)
    split = tp if sequence_parallel else 1
    # Per kind of block (an MoE model's dense and MoE ones: ActivationSpec.block): what a layer stores, keeps, and
    # holds at its backward's heaviest (recomputed beneath under checkpointing); chunks' blocks counted by kind.
    specs = {moe: spec.block(moe) for moe in (False, True)}
    full = {m: layer_bytes(s, b, h, a, tp, specs[m], cp, sequence_parallel) for m in specs}
    kept = {m: checkpoint_bytes(s, b, h, spec) / split if checkpointing else full[m] for m in specs}
    heavy = {m: (full[m] if checkpointing else 0.0) + block_workspace(s, b, h, tp, specs[m], sequence_parallel)
             for m in specs}
    pp = len(stage_layers)
    chunks_per_rank = virtual if pp > 1 else 1
    if chunk_layers is None:
        chunk_layers = [len(r) for n in stage_layers for r in uniform_stage_layers(n, chunks_per_rank)]
        chunk_layers = [chunk_layers[rank * chunks_per_rank + c] for c in range(chunks_per_rank) for rank in range(pp)]
    stages = len(chunk_layers)
    starts = [sum(chunk_layers[:c]) for c in range(stages)]
    moe_blocks = [sum(map(cfg.moe_layer, range(starts[c], starts[c] + chunk_layers[c]))) if spec.moe_token_bytes
                  else 0 for c in range(stages)]
    count = lambda c, m: moe_blocks[c] if m else chunk_layers[c] - moe_blocks[c]  # noqa: E731
    present = lambda c: [m for m in specs if count(c, m)]  # noqa: E731
    sbh = s * b * h
    # the logits and, below fp32, the reference loss's fp32 copy of them (the fused cross-entropy makes none)
    loss = (e + (4 if e < 4 and not spec.fused_ce else 0)) * s * b * vocab / tp
    # The fused cross-entropy's fp32 rows in flight instead (kernels/cross_entropy.py): forward holds two chunks (a
    # chunk and its exp, or it and the next one being copied), backward d logits and one chunk, two when there are
    # more. None when the head and loss are fused (train.fused_loss: no logits at all).
    rows, chunk_rows = s * b, max(1, CE_CHUNK_ELEMENTS // (vocab // tp))
    chunk = 4 * min(rows, chunk_rows) * vocab / tp if spec.fused_ce and not fused_loss else 0.0
    ce_forward, ce_backward = 2 * chunk, (2 if rows > chunk_rows else 1) * chunk
    head_grad = (4 if spec.weight_copies else e) * vocab / tp * h  # the head's weight gradient as autograd makes it
    mtp_kept, mtp_moment, mtp_kinds = mtp_terms(  # MTP on the last stage (planner/moe.py): never a fused loss
        cfg, spec, full, heavy, sbh, split, loss, head_grad, checkpointing)
    if fused_loss:  # (dh: the e sbh beside the final norm's input, in place of the head's input) + dW
        loss = e * vocab / tp * h
        # forward's peak inside the loss (parallel/tensor/linear_cross_entropy.py), beside dW's fp32 accumulator:
        # the chunk's fp32 logits with (below fp32) their 16-bit product, then d logits; or, once the logits are
        # freed, d logits with their 16-bit dW product; or at the end dW's 16-bit cast (no larger than that).
        # The product never meets the fp32 chunk (deleted first); 405B's last stage peaks at it (chunk_rows_for).
        from megazoo.parallel.tensor.linear_cross_entropy import chunk_rows_for  # torch: `plan --help` loads none

        c, below, wide = chunk_rows_for(s * b, vocab // tp), e if e < 4 else 0, max(e, 4)
        fused_forward = wide * vocab / tp * h + max((wide + below) * c * vocab / tp,
                                                     below * (c * vocab / tp + vocab / tp * h))
    grad_in = e * sbh / split  # a gradient arriving at a stage, (b, s, d)
    d_block = {m: weight_gradient_inputs(s, b, h, tp, specs[m], sequence_parallel)  # + MLA's and MoE's (moe.py)
               + store_terms(cfg, specs[m], s, b, tp, sequence_parallel, m) for m in specs}

    def chunk_bytes(stage: int, recompute: float) -> tuple[ChunkBytes, float]:
        """`recompute`: the layer recomputed on this chunk's rank (its largest), which the rank's total counts."""
        n, first, last = chunk_layers[stage], stage == 0, stage == stages - 1
        n_moe = moe_blocks[stage]
        extra = spec.mask_bytes * sbh if first and spec.dropout else 0.0
        out = 0.0 if last else spec.residual * sbh / split  # the stage's output, kept until its backward
        if last:
            # the final norm's input (s / tp long under sequence parallelism) and the head's (gathered)
            extra += (spec.residual / split + e) * sbh + loss + mtp_kept
            if spec.weight_copies and not fused_loss:  # the head's 16-bit cast of its vocabulary shard, for backward
                extra += e * vocab / tp * h
        forward = (n - n_moe) * kept[False] + n_moe * kept[True] + extra + out
        d_logits = e * s * b * vocab / tp
        if checkpointing:  # W re-traverses: B keeps its root and the gradient at it
            after_b = forward - loss + d_logits if last else forward + grad_in
        elif first:  # no input gradient: B is empty and W the whole backward, from the kept gradient
            after_b = forward + grad_in
        else:  # B released the graph: the store's x and dY per linear; the head's weight gradient, or its
            # input and d logits where those are smaller (an untied head under sequence parallelism gathers
            # inside its backward: always its weight gradient, fp32 under autocast)
            sp_head = sequence_parallel and not cfg.tie_embeddings
            head = head_grad if sp_head else min(d_logits + e * sbh, e * vocab / tp * h)
            after_b = (n - n_moe) * d_block[False] + n_moe * d_block[True] + (head if last else 0.0)
        workspace = 0.0
        if n:  # one block's backward at its heaviest moment (block_workspace); last stage: the head's freed by then
            workspace = max(heavy[m] for m in present(stage)) - recompute - (extra if last else 0.0)
        workspace = max(workspace, mtp_moment - recompute) if last and mtp_kinds else workspace  # MTP's blocks
        loss_backward = e * s * b * (vocab / tp + h) + ce_backward  # d logits, the head input's gradient
        loss_forward = 0.0
        if fused_loss:  # backward scales the kept dh and dW in place (a block of rows at a time): nothing beside
            loss_backward = 0.0
            # The loss's forward (the 405B recipe's last stage peaks there): its own bytes beside the head's input
            # and dh (and under sequence parallelism the norm's output it was gathered from), while no block is
            # recomputed, which the stage's total counts under checkpointing (+15% over its dry run before)
            loss_forward = (fused_forward - loss + e * sbh * (1 + (1 / split if sequence_parallel else 0))
                            - (recompute if n else 0.0))
        if last and schedule in SPLIT_BACKWARD:
            # split B (split_backward.py) runs the loss's and the blocks' input gradients in one pass that frees
            # nothing of the head before the last block's MLP (or MoE) temporaries exist: they add up (measured
            # on test_schedule_memory.py's pipelines: ZB-H1's last stage is +12% over the planner otherwise)
            workspace = loss_backward + input_pass(specs, present(stage), s, b, h, tp, sequence_parallel)
        # The peak adds one recomputed layer under checkpointing (total_bytes), yet the loss's backward runs before
        # any is: for MoE models (qwen3-30b-a3b's dry run peaks there) that moment is net of it. Dense models keep the
        # double count, standing in for ZeRO-2's head gradient buckets in 405B's recomputed backward (netting: -23%).
        again = recompute if n and n_moe else 0.0
        if last and schedule not in SPLIT_BACKWARD:  # the unsplit backward frees d logits before the blocks' (405B);
            head_bw = 0.0 if fused_loss or not head_trained else loss_backward - ce_backward + head_grad - loss  # its
            workspace = max(workspace, loss_backward - again, head_bw - again)  # head's dW, logits freed (V3)
        if last:  # the loss's forward runs on top of everything the chunk holds, as its backward does
            workspace = max(workspace, ce_forward, loss_forward)
        return ChunkBytes(forward, after_b, workspace), extra + out

    out = []
    for rank, n in enumerate(stage_layers):
        held = rank_chunks(list(range(stages)), pp, rank, placement_of(schedule)) if pp > 1 else [0]
        kinds = [m for c in held for m in present(c) + (mtp_kinds if c == stages - 1 else [])]
        recompute = max((full[m] for m in kinds), default=0.0) if checkpointing and n else 0.0  # the largest
        chunks = [chunk_bytes(st, recompute) for st in held]
        try:
            peak = rank_peak(schedule, micro_batches, pp, rank, virtual, [c for c, _ in chunks])
        except ValueError as err:
            raise PlanError(str(err)) from None
        at_rest = rank_peak(schedule, micro_batches, pp, rank, virtual,  # what B..W would hold as F..B
                            [ChunkBytes(c.forward, c.forward) for c, _ in chunks]).held
        stored = sum(kept[m] * count(c, m) for c in held for m in specs)
        out.append(StageActivations(rank, n, peak.live / len(held), stored / n if n else kept[False], recompute,
                                    sum(x for _, x in chunks), peak.held, max(peak.held - at_rest, 0.0),
                                    peak.peak - peak.held))
    return out
