"""The GPT's parameters, described once, and the (tp, pp) layouts a config admits.

`parameter_layout` lists every parameter models/transformer.py allocates: its global name, its global shape and
how tensor parallelism splits it. Everything else that needs the model's shapes derives them from here:
`ModelConfig.num_parameters`, the Hugging Face GPT-2 import/export check (models/hf/gpt2.py), the ZeRO planner's
per-device counts (recipes/planner/shards.py) and the "parameters" pipeline balancing (recipes/resolve.py).
tests/models/test_layout.py holds it equal to what a meta-device model really allocates, at tp = 1 and tp = 2.

`check_parallel_compat` is the one check of a (tp, pp) layout against a config: the model's constructor, the
recipe resolver and the planner all call it, so a bad layout reads the same wherever it is caught.

Pure arithmetic on the config's fields (no torch), so a 1T-parameter preset is described in microseconds.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol


class ModelConfig(Protocol):
    """The fields of models/config.py's ModelConfig that the layout reads. The config imports this module (its
    num_parameters counts this layout), so the layout describes what it needs instead of importing it back."""

    name: str
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    d_ff: int
    head_dim: int
    n_positions: int
    vocab_size: int
    norm: str
    positions: str
    mlp: str
    fused_qkv: bool
    tie_embeddings: bool
    qkv_bias: bool
    proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    mla: bool
    kv_lora_rank: int
    q_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_experts: int
    moe_d_ff: int
    moe_shared_experts: int
    moe_shared_d_ff: int
    moe_shared_gate: bool
    moe_aux_loss_coef: float
    moe_z_loss_coef: float
    moe_aux_loss_scope: str

    def padded_vocab(self, tp: int = 1) -> int: ...

    def moe_layer(self, index: int) -> bool: ...


class ParamSpec(NamedTuple):
    """One parameter of the full model."""

    name: str  # global name, as models/transformer.py registers it: "wte.weight", "h.3.attn.c_attn.weight"
    shape: tuple[int, ...]  # global (unsharded) shape
    tp_dim: int | None  # the dim split over the tp ranks; None: replicated on every tp rank
    sections: int = 1  # tp_dim is this many equal blocks, each split over tp (3: fused [Q; K; V], whole heads)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one tp rank holds (parallel/tensor's ShardSpec.local_shape)."""
        if self.tp_dim is None:
            return self.shape
        return tuple(n // tp if dim == self.tp_dim else n for dim, n in enumerate(self.shape))

    def local_numel(self, tp: int) -> int:
        return math.prod(self.local_shape(tp))


def kv_split(cfg: ModelConfig, tp: int) -> bool:
    """Whether the key/value heads of a grouped-query config are split over tp (tp divides n_kv_head); otherwise
    (tp a multiple of n_kv_head) every rank holds all of them and uses the one its query heads share."""
    return cfg.n_kv_head % tp == 0


def _linear(name: str, out: int, inp: int, tp_dim: int, bias: bool, sections: int = 1) -> list[ParamSpec]:
    """A column- (tp_dim 0) or row-parallel (tp_dim 1) linear layer, its bias split like its output rows (column)
    or replicated (row; added after the all-reduce). tp_dim None: a replicated layer."""
    sections = sections if tp_dim is not None else 1
    params = [ParamSpec(name + ".weight", (out, inp), tp_dim, sections)]
    if bias:
        params.append(ParamSpec(name + ".bias", (out,), 0 if tp_dim == 0 else None, sections))
    return params


def _norm(cfg: ModelConfig, name: str) -> list[ParamSpec]:
    d = cfg.d_model
    return [ParamSpec(name + ".weight", (d,), None)] + \
        ([ParamSpec(name + ".bias", (d,), None)] if cfg.norm == "layernorm" else [])


def block_parameters(cfg: ModelConfig, index: int, tp: int = 1) -> list[ParamSpec]:
    """Block `index`: norms and row-parallel biases replicated; column-parallel weights and biases split on dim 0
    (GPT-2's fused QKV in 3 head-aligned sections, grouped-query [K; V] in 2, SwiGLU's [gate; up] in 2);
    row-parallel weights split on dim 1 (their input). Grouped-query K/V is replicated where tp > n_kv_head."""
    d, f, h, hd = cfg.d_model, cfg.d_ff, f"h.{index}.", cfg.head_dim
    params = _norm(cfg, h + "ln_1")
    if cfg.mla:
        params += mla_parameters(cfg, h)
    elif cfg.fused_qkv:
        params += _linear(h + "attn.c_attn", 3 * d, d, 0, cfg.qkv_bias, 3)
    else:
        params += _linear(h + "attn.c_q", cfg.n_head * hd, d, 0, cfg.qkv_bias)
        params += _linear(h + "attn.c_kv", 2 * cfg.n_kv_head * hd, d, 0 if kv_split(cfg, tp) else None,
                          cfg.qkv_bias, 2)
    if not cfg.mla:
        params += _linear(h + "attn.c_proj", d, cfg.n_head * hd, 1, cfg.proj_bias)
    if cfg.qk_norm:  # Qwen3: one per-head RMSNorm weight for q and one for k, replicated
        params += [ParamSpec(h + "attn.q_norm.weight", (hd,), None), ParamSpec(h + "attn.k_norm.weight", (hd,), None)]
    params += _norm(cfg, h + "ln_2")
    if cfg.moe_layer(index):
        return params + moe_parameters(cfg, h)
    gated = cfg.mlp == "swiglu"
    params += _linear(h + "mlp.c_fc", 2 * f if gated else f, d, 0, cfg.mlp_bias, 2 if gated else 1)
    params += _linear(h + "mlp.c_proj", d, f, 1, cfg.mlp_bias)
    return params


def mla_parameters(cfg: ModelConfig, h: str) -> list[ParamSpec]:
    """Latent attention (models/deepseek/mla.py): the down-projections (q_a, kv_a: [latent; shared rotary key])
    and the latents' RMSNorm weights replicated over tp; the up-projections (q_b, or c_q without q compression,
    and kv_b) column-parallel in whole heads; c_proj row-parallel. No biases (DeepSeek's attention_bias false)."""
    d, n, r = cfg.d_model, cfg.n_head, cfg.kv_lora_rank
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        params = [ParamSpec(h + "attn.q_a.weight", (cfg.q_lora_rank, d), None),
                  ParamSpec(h + "attn.q_a_norm.weight", (cfg.q_lora_rank,), None),
                  ParamSpec(h + "attn.q_b.weight", (n * qk, cfg.q_lora_rank), 0)]
    else:
        params = [ParamSpec(h + "attn.c_q.weight", (n * qk, d), 0)]
    return params + [ParamSpec(h + "attn.kv_a.weight", (r + cfg.qk_rope_head_dim, d), None),
                     ParamSpec(h + "attn.kv_a_norm.weight", (r,), None),
                     ParamSpec(h + "attn.kv_b.weight", (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), r), 0),
                     ParamSpec(h + "attn.c_proj.weight", (d, n * cfg.v_head_dim), 1)]


def moe_parameters(cfg: ModelConfig, h: str) -> list[ParamSpec]:
    """An MoE block (models/moe/block.py): the router and the routed experts, stacked (E, out, in), replicated over
    tp (expert-tp 1; expert parallelism splits dim 0 over the ep ranks); the shared experts one tensor-parallel
    SwiGLU of width moe_shared_experts x moe_shared_d_ff; Qwen2-MoE's shared gate (1, d), replicated."""
    d, e, f = cfg.d_model, cfg.n_experts, cfg.moe_d_ff
    params = [ParamSpec(h + "mlp.router.weight", (e, d), None),
              ParamSpec(h + "mlp.experts.c_fc.weight", (e, 2 * f, d), None),
              ParamSpec(h + "mlp.experts.c_proj.weight", (e, d, f), None)]
    if cfg.moe_shared_experts:
        s = cfg.moe_shared_experts * cfg.moe_shared_d_ff
        params += _linear(h + "mlp.shared.c_fc", 2 * s, d, 0, False, 2) + _linear(h + "mlp.shared.c_proj", d, s, 1, False)
        if cfg.moe_shared_gate:
            params.append(ParamSpec(h + "mlp.shared_gate.weight", (1, d), None))
    return params


# Routed-expert parameters: what `ModelConfig.num_active_parameters` counts k of E, and what expert parallelism splits.
EXPERT_PARAMETERS = (".mlp.experts.c_fc.weight", ".mlp.experts.c_proj.weight")


def parameter_layout(cfg: ModelConfig, tp: int = 1, *, vocab: int | None = None, layers: range | None = None,
                     embedding: bool = True, head: bool = True) -> list[ParamSpec]:
    """Every parameter of one (pipeline stage of a) GPT, in the model's registration order.

    `vocab`: rows of the word embedding (and of an untied head); default the padded vocabulary at `tp` (what the
    model allocates), give cfg.vocab_size for the true one (checkpoints, counts). `layers`, `embedding`, `head`:
    the blocks and ends a pipeline stage holds (GPT's `layers`, `with_embedding`, `with_head`). A tied head owns
    its own reference to the word embedding, so a last stage without the embedding still lists wte.weight; an
    untied head is lm_head.weight, column-parallel over the vocabulary.
    """
    d = cfg.d_model
    vocab = cfg.padded_vocab(tp) if vocab is None else vocab
    params = []
    if embedding or (head and (cfg.tie_embeddings or getattr(cfg, "mtp_depth", 0))):  # MTP's next-token lookup
        params.append(ParamSpec("wte.weight", (vocab, d), 0))
    if embedding and cfg.positions == "learned":
        params.append(ParamSpec("wpe.weight", (cfg.n_positions, d), None))
    for i in range(cfg.n_layer) if layers is None else layers:
        params += block_parameters(cfg, i, tp)
    if head:
        params += _norm(cfg, "ln_f")
        if not cfg.tie_embeddings:
            params.append(ParamSpec("lm_head.weight", (vocab, d), 0))
        params += mtp_parameters(cfg, tp)
    return params


def mtp_parameters(cfg: ModelConfig, tp: int = 1) -> list[ParamSpec]:
    """DeepSeek-V3's multi-token prediction modules (models/deepseek/mtp.py) on the last stage, depth k under
    "mtp.layers.{k-1}.": hnorm, enorm (RMSNorm), eh_proj (d, 2d) replicated, the decoder's block for layer
    n_layer + k - 1 (MoE where that layer would be), its final norm."""
    d, params = cfg.d_model, []
    for k in range(getattr(cfg, "mtp_depth", 0)):
        m, index = f"mtp.layers.{k}.", cfg.n_layer + k
        params += [ParamSpec(m + "hnorm.weight", (d,), None), ParamSpec(m + "enorm.weight", (d,), None),
                   ParamSpec(m + "eh_proj.weight", (d, 2 * d), None)]
        params += [p._replace(name=m + "block." + p.name[len(f"h.{index}."):]) for p in block_parameters(cfg, index, tp)]
        params.append(ParamSpec(m + "norm.weight", (d,), None))
    return params


# Parameters whose rows are the (padded) vocabulary: trimmed to the true vocabulary in full states.
VOCAB_PARAMETERS = ("wte.weight", "lm_head.weight")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_parallel_compat(cfg: ModelConfig, tp: int, pp: int = 1) -> None:
    """Raise ValueError unless `cfg` can be split over `tp` tensor-parallel ranks and `pp` pipeline stages.

    tp must divide the attention heads (a rank holds whole heads) and the MLP width, and divide or be a multiple
    of the key/value heads (split or replicated); pp must not exceed the blocks. The message names the field, the value and what would be valid.
    """
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel.{name} = {value!r} is invalid: it must be an integer >= 1")
    shared = cfg.moe_shared_experts * cfg.moe_shared_d_ff if cfg.n_experts else 0
    valid_tp = ", ".join(str(k) for k in divisors(cfg.n_head) if cfg.d_ff % k == 0 and shared % k == 0
                         and (cfg.n_kv_head % k == 0 or k % cfg.n_kv_head == 0))
    if cfg.n_head % tp:
        raise ValueError(f"parallel.tp = {tp} does not divide the {cfg.n_head} attention heads of {cfg.name} "
                         f"(model.n_head = {cfg.n_head}, divisors {divisors(cfg.n_head)}); valid tp: {valid_tp}")
    if cfg.d_ff % tp:
        raise ValueError(f"parallel.tp = {tp} does not divide the MLP width of {cfg.name} "
                         f"(model.d_ff = {cfg.d_ff}); valid tp: {valid_tp}")
    if shared % tp:
        raise ValueError(f"parallel.tp = {tp} does not divide the shared experts' width of {cfg.name} "
                         f"(model.moe_shared_experts x model.moe_shared_d_ff = {shared}); valid tp: {valid_tp}")
    if cfg.n_kv_head % tp and tp % cfg.n_kv_head:
        raise ValueError(f"parallel.tp = {tp} neither divides nor is a multiple of the {cfg.n_kv_head} key/value "
                         f"heads of {cfg.name} (model.n_kv_head = {cfg.n_kv_head}): a rank's query heads must share "
                         f"whole key/value heads (split when tp divides them, replicated when tp is a multiple); "
                         f"valid tp: {valid_tp}")
    if pp > 1 and cfg.n_experts and (cfg.moe_aux_loss_coef or cfg.moe_z_loss_coef) \
            and cfg.moe_aux_loss_scope == "model":
        raise ValueError(f"parallel.pp = {pp} with model.moe_aux_loss_scope = 'model': the auxiliary losses pooled "
                         f"over all MoE layers need every layer on one stage; valid: parallel.pp = 1, or "
                         f"model.moe_aux_loss_scope = 'layer' (each layer's own loss, as Megatron)")
    if pp > cfg.n_layer:
        raise ValueError(f"parallel.pp = {pp} is larger than the number of blocks of {cfg.name} "
                         f"(model.n_layer = {cfg.n_layer} blocks); valid pp: 1..{cfg.n_layer}")
