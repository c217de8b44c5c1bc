"""ModelConfig and the preset registry.

Presets are frozen dataclass instances registered per model family (models/gpt2, models/turing_nlg). Nothing
switches behaviour on a preset's name: everything a model does follows from the fields. The parameters those
fields imply (names, shapes, tp splits) and the (tp, pp) layouts they admit are described in models/layout.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megazoo.models.deepseek.fields import check_mla
from megazoo.models.deepseek.checks import check_mtp, check_node_limit
from megazoo.models.layout import parameter_layout


# Block-sparse attention's layouts (models/sparse_attention.py builds them; named here so that checking a config
# needs no torch).
SPARSE_PATTERNS = ("fixed", "bigbird", "sliding_window")


@dataclass(frozen=True)
class ModelConfig:
    """A pre-norm decoder. The defaults are GPT-2's block (LayerNorm, learned positions, tanh-GELU MLP, biases
    everywhere, tied embeddings); the architecture fields below give the Llama-style block (RMSNorm, rotary
    positions, SwiGLU, grouped-query attention, untied head, Qwen2's qkv bias, Mistral's sliding window)."""

    name: str
    n_layer: int
    n_head: int
    d_model: int
    n_positions: int = 1024
    vocab_size: int = 50257
    d_ff: int = 0  # 0 means 4 * d_model, as GPT-2
    dropout: float = 0.1  # embeddings and residual branches
    attn_dropout: float = 0.1
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    vocab_multiple: int = 128  # the padded vocabulary is a multiple of vocab_multiple * tp
    # Architecture options (models/transformer.py, attention.py, mlp.py, rotary.py); the defaults are GPT-2's.
    norm: str = "layernorm"  # "layernorm" (weight + bias) | "rmsnorm" (weight); eps: layer_norm_eps
    positions: str = "learned"  # "learned" (wpe) | "rotary" (no weights; rope_* below)
    mlp: str = "gelu"  # "gelu": d -> d_ff -> d, tanh-GELU | "swiglu": down(silu(gate(x)) * up(x))
    n_kv_head: int = 0  # key/value heads (grouped-query attention); 0 means n_head
    tie_embeddings: bool = True  # the output head is the input embedding (False: its own lm_head)
    qkv_bias: bool = True  # bias of the query/key/value projections (GPT-2, Qwen2)
    proj_bias: bool = True  # bias of the attention output projection
    mlp_bias: bool = True  # biases of the MLP's matrices
    sliding_window: int = 0  # a query sees this many positions, itself included (Mistral); 0: all earlier ones
    rope_theta: float = 10000.0  # rotary base
    rope_scaling: str = "none"  # "none" | "llama3" (Llama 3.1's frequency-dependent scaling, as HF computes it)
    rope_factor: float = 8.0  # llama3: low frequencies divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / low_freq_factor are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / high_freq_factor are kept
    rope_original_positions: int = 8192  # llama3 / yarn: the context the model was pretrained at
    # YaRN (rope_scaling = "yarn", latent attention only; with rope_factor): beta_fast / beta_slow bound the ramp
    # between kept and interpolated frequencies; mscale / mscale_all_dim give the attention-scale correction
    # (models/deepseek/fields.py: the softmax scale times mscale(factor, mscale_all_dim)^2, as DeepSeek-V3)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    # Block-sparse attention (models/sparse_attention.py): no weights, so none of these is an architecture field.
    attention: str = "dense"  # "dense" | "sparse"
    sparse_pattern: str = "fixed"  # "fixed" | "bigbird" | "sliding_window"
    sparse_block: int = 16  # tokens per block
    sparse_local_blocks: int = 4  # fixed: blocks per window; bigbird / sliding_window: the window, itself included
    sparse_global_blocks: int = 1  # fixed: summary blocks at the end of each window; bigbird: the first blocks
    sparse_random_blocks: int = 1  # bigbird: random earlier blocks per query block
    sparse_seed: int = 0  # bigbird: the random blocks' seed (the same pattern in every layer and run)
    # Qwen3's attention (models/attention.py): the head width may differ from d_model / n_head, and q and k are
    # RMS-normalised per head (one weight of head_dim, shared by the heads) before the rotary positions.
    # head_width 0 (the default) keeps d_model / n_head, also across replace(d_model=...): `head_dim` reads it.
    head_width: int = 0
    qk_norm: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3, models/deepseek/mla.py), on when kv_lora_rank > 0: keys and
    # values from one RMS-normalised kv_lora_rank latent per token, queries from a q_lora_rank latent (0: a full
    # projection, as V2-Lite); q and k heads are qk_nope_head_dim + qk_rope_head_dim wide (the rotary part of k
    # one head shared by all), values v_head_dim. Checked in models/deepseek/fields.py.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts (models/moe/): the MLP of an MoE layer is n_experts routed SwiGLU experts (no biases), of
    # which each token uses moe_top_k, plus optional always-on shared experts. n_experts = 0: a dense model.
    n_experts: int = 0
    moe_top_k: int = 2
    moe_d_ff: int = 0  # one routed expert's hidden width; 0 means d_ff
    moe_shared_experts: int = 0  # shared experts, run as one SwiGLU of moe_shared_experts x moe_shared_d_ff
    moe_shared_d_ff: int = 0  # one shared expert's width; 0 means moe_d_ff
    moe_shared_gate: bool = False  # Qwen2-MoE: the shared output scaled by sigmoid(x . w), w of shape (1, d)
    # Which layers are MoE: layer i (from 0) is when i >= moe_first_dense (DeepSeek's first_k_dense_replace), (i +
    # 1) % moe_every == 0 (Qwen's decoder_sparse_step) and i is not in moe_dense_layers (Qwen's mlp_only_layers).
    moe_first_dense: int = 0
    moe_every: int = 1
    moe_dense_layers: tuple[int, ...] = ()
    # Router (models/moe/router.py, always in fp32 or wider): "softmax" scores over all experts, top-k, then
    # renormalised to sum 1 when moe_norm_topk_prob (Mixtral, Qwen3-MoE) or kept as they are (Qwen2-MoE), and for
    # DeepSeek-V2 within moe_topk_group of moe_n_group groups (a group scored by its best) and scaled;
    # "sigmoid_bias" (DeepSeek-V3): sigmoid scores, chosen over scores + a per-expert bias (a buffer moved after
    # each step by moe_bias_update_rate x sign(mean load - load)), optionally within moe_topk_group of moe_n_group
    # expert groups, weights renormalised when moe_norm_topk_prob and scaled by moe_routed_scaling_factor.
    moe_router: str = "softmax"
    moe_norm_topk_prob: bool = True
    moe_n_group: int = 1  # DeepSeek's n_group: the experts in this many equal groups (V2's softmax, V3's sigmoid_bias)
    moe_topk_group: int = 1  # DeepSeek's topk_group: a token's experts come from this many groups
    moe_routed_scaling_factor: float = 1.0  # the routed experts' weights times this (DeepSeek-V2 / V3)
    # DeepSeek-V3's node-limited routing (sigmoid_bias only): the experts lie on moe_nodes nodes (expert e on node
    # e // (n_experts / moe_nodes), as expert parallelism places them: the resolver checks the layout does) and
    # a token's experts come from at most moe_max_nodes of them, those with the highest sums of their
    # ceil(top_k / moe_max_nodes) best biased scores; 0: no limit
    moe_nodes: int = 1
    moe_max_nodes: int = 0
    moe_bias_update_rate: float = 0.0  # DeepSeek-V3's bias update speed gamma (0.001 in its report); 0: frozen
    # DeepSeek-V3's sequence-wise balance loss (its alpha, 0.0001 in the report; sigmoid_bias only), each MoE
    # layer's own, summed over layers, averaged over the micro-batch's sequences (models/moe/losses.py)
    moe_seq_aux_loss_coef: float = 0.0
    moe_aux_loss_coef: float = 0.0  # load balancing (Switch / HF's router_aux_loss_coef), added in training
    moe_z_loss_coef: float = 0.0  # router z-loss (ST-MoE), added in training
    # "model": pooled over all MoE layers, as transformers' aux_loss (the decoder's loss adds it; a pipeline stage
    # does not see the others' layers, so pp > 1 needs "layer"); "layer": each layer's own loss, averaged over the
    # MoE layers, its gradient injected in that layer's backward (as Megatron's MoEAuxLossAutoScaler)
    moe_aux_loss_scope: str = "model"
    moe_capacity_factor: float = 0.0  # 0: dropless; else each expert takes ceil(factor x tokens x k / E) at most
    moe_experts_impl: str = "grouped"  # "grouped": one grouped matmul (torch._grouped_mm) | "loop": per expert
    # DeepSeek-V3's multi-token prediction (models/deepseek/mtp.py): mtp_depth extra modules on the last stage, the
    # k-th predicting token t + 1 + k; their mean loss times mtp_loss_weight is added to the loss in training.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3  # DeepSeek-V3's lambda (0.3, then 0.1 for its last 4.8T tokens)

    def __post_init__(self):
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.n_kv_head == 0:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.moe_d_ff == 0:
            object.__setattr__(self, "moe_d_ff", self.d_ff)
        if self.moe_shared_d_ff == 0:
            object.__setattr__(self, "moe_shared_d_ff", self.moe_d_ff)
        if isinstance(self.moe_dense_layers, list):  # TOML arrays and checkpoints' JSON
            object.__setattr__(self, "moe_dense_layers", tuple(self.moe_dense_layers))
        for field in ("n_layer", "n_head", "d_model", "n_positions", "vocab_size", "d_ff", "vocab_multiple",
                      "n_kv_head"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{field} = {value!r} is invalid: it must be a positive integer")
        if not isinstance(self.head_width, int) or isinstance(self.head_width, bool) or self.head_width < 0:
            raise ValueError(f"model.head_width = {self.head_width!r} is invalid: it must be an integer >= 0 (0: "
                             "d_model / n_head)")
        if self.d_model % self.n_head and not self.head_width:
            raise ValueError(f"model.d_model = {self.d_model} is not divisible by model.n_head = {self.n_head}")
        for field in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"model.{field} = {getattr(self, field)} must be in [0, 1)")
        self._check_architecture()
        self._check_sparse()
        check_moe(self)
        check_mla(self)
        check_mtp(self)

    def _check_architecture(self) -> None:
        for field, valid in (("norm", NORMS), ("positions", POSITIONS), ("mlp", MLPS), ("rope_scaling", ROPE_SCALINGS)):
            if getattr(self, field) not in valid:
                raise ValueError(f"model.{field} = {getattr(self, field)!r} is invalid; valid: "
                                 f"{', '.join(repr(v) for v in valid)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_kv_head = {self.n_kv_head} does not divide model.n_head = {self.n_head}; "
                             f"valid: {[k for k in range(1, self.n_head + 1) if self.n_head % k == 0]}")
        if self.positions == "rotary" and self.head_dim % 2 and not self.kv_lora_rank:
            raise ValueError(f"model.positions = 'rotary' needs an even head dimension, got d_model / n_head = "
                             f"{self.head_dim}")
        for field in ("tie_embeddings", "qkv_bias", "proj_bias", "mlp_bias", "qk_norm"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"model.{field} = {getattr(self, field)!r} is invalid: it must be true or false")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"model.sliding_window = {self.sliding_window!r} is invalid: it must be an integer "
                             ">= 0 (0: no window)")
        if self.sliding_window and self.attention != "dense":
            raise ValueError("model.sliding_window needs model.attention = 'dense' (the sparse patterns have their "
                             "own windows)")
        if not self.rope_theta > 0:
            raise ValueError(f"model.rope_theta = {self.rope_theta} is invalid: it must be positive")
        if self.rope_scaling == "llama3" and not (self.rope_factor > 0 and self.rope_original_positions > 0
                                                   and self.rope_high_freq_factor > self.rope_low_freq_factor > 0):
            raise ValueError(f"model.rope_scaling = 'llama3' needs rope_factor > 0, rope_original_positions > 0 and "
                             f"rope_high_freq_factor > rope_low_freq_factor > 0; got {self.rope_factor}, "
                             f"{self.rope_original_positions}, {self.rope_high_freq_factor}, "
                             f"{self.rope_low_freq_factor}")

    def _check_sparse(self) -> None:
        if self.attention not in ("dense", "sparse"):
            raise ValueError(f"model.attention = {self.attention!r} is invalid; valid: 'dense', 'sparse'")
        if self.sparse_pattern not in SPARSE_PATTERNS:
            raise ValueError(f"model.sparse_pattern = {self.sparse_pattern!r} is invalid; valid: "
                             f"{', '.join(repr(p) for p in SPARSE_PATTERNS)}")
        for field, low in (("sparse_block", 1), ("sparse_local_blocks", 1), ("sparse_global_blocks", 0),
                           ("sparse_random_blocks", 0), ("sparse_seed", 0)):
            value = getattr(self, field)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"model.{field} = {value!r} is invalid: it must be an integer >= {low}")
        if self.sparse_pattern == "fixed" and self.sparse_global_blocks > self.sparse_local_blocks:
            raise ValueError(f"model.sparse_global_blocks = {self.sparse_global_blocks} is larger than the window "
                             f"(model.sparse_local_blocks = {self.sparse_local_blocks}); valid: "
                             f"0..{self.sparse_local_blocks}")

    @property
    def head_dim(self) -> int:
        """The width of one attention head: head_width, or d_model / n_head."""
        return self.head_width or self.d_model // self.n_head

    @property
    def fused_qkv(self) -> bool:
        """Multi-head attention keeps GPT-2's fused [Q; K; V] projection (attn.c_attn); grouped-query attention
        has attn.c_q and attn.c_kv ([K; V], n_kv_head heads each), so K/V can be replicated where tp > n_kv_head.
        Heads narrower or wider than d_model / n_head (Qwen3's head_dim) take the c_q / c_kv pair too."""
        return self.n_kv_head == self.n_head and self.head_dim * self.n_head == self.d_model

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (kv_lora_rank > 0) in place of multi-head / grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def moe_layer(self, index: int) -> bool:
        """Whether block `index` (from 0) has the MoE block in place of the dense MLP (the field comments above)."""
        return (self.n_experts > 0 and index >= self.moe_first_dense and (index + 1) % self.moe_every == 0
                and index not in self.moe_dense_layers)

    def num_active_parameters(self, vocab: int | None = None) -> int:
        """Parameters one token uses: all of them but the routed experts it is not sent to (each MoE layer's
        n_experts - moe_top_k experts' weights are left out), the convention of "30B-A3B"."""
        idle = sum(self.n_experts - self.moe_top_k for i in range(self.n_layer + self.mtp_depth) if self.moe_layer(i))
        return self.num_parameters(vocab) - idle * 3 * self.d_model * self.moe_d_ff

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of vocab_multiple * tp (so every tp shard is whole and aligned)."""
        multiple = self.vocab_multiple * tp
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self, vocab: int | None = None) -> int:
        """Exact parameter count of the full model (tied embeddings counted once), from models/layout.py;
        `vocab` (rows of the word embedding) defaults to the true size."""
        return sum(p.numel for p in parameter_layout(self, vocab=self.vocab_size if vocab is None else vocab))

    def replace(self, **changes) -> "ModelConfig":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown model field(s) {sorted(unknown)}; valid: {model_fields()}")
        if "d_model" in changes and "d_ff" not in changes and self.d_ff == 4 * self.d_model:
            changes["d_ff"] = 0  # the MLP width follows d_model (4x) unless it was set on its own
        if "n_head" in changes and "n_kv_head" not in changes and self.n_kv_head == self.n_head:
            changes["n_kv_head"] = 0  # multi-head attention stays multi-head
        if "d_ff" in changes and "moe_d_ff" not in changes and self.moe_d_ff == self.d_ff:
            changes["moe_d_ff"] = 0
        if "moe_d_ff" in changes and "moe_shared_d_ff" not in changes and self.moe_shared_d_ff == self.moe_d_ff:
            changes["moe_shared_d_ff"] = 0
        return dataclasses.replace(self, **changes)


NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
MLPS = ("gelu", "swiglu")
ROPE_SCALINGS = ("none", "llama3", "yarn")
MOE_ROUTERS = ("softmax", "sigmoid_bias")
MOE_EXPERT_IMPLS = ("grouped", "loop")
MOE_AUX_SCOPES = ("model", "layer")


def check_moe(cfg: ModelConfig) -> None:
    """The MoE fields (see ModelConfig); messages name the field, the value and what is valid."""
    for field in ("n_experts", "moe_first_dense", "moe_shared_experts"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"model.{field} = {value!r} is invalid: it must be an integer >= 0")
    if not cfg.n_experts:
        return
    for field in ("moe_top_k", "moe_d_ff", "moe_shared_d_ff", "moe_every"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model.{field} = {value!r} is invalid: it must be a positive integer")
    if cfg.moe_top_k > cfg.n_experts:
        raise ValueError(f"model.moe_top_k = {cfg.moe_top_k} is larger than model.n_experts = {cfg.n_experts}; "
                         f"valid: 1..{cfg.n_experts}")
    if cfg.mlp != "swiglu" or cfg.mlp_bias:
        raise ValueError(f"model.n_experts = {cfg.n_experts} needs model.mlp = 'swiglu' and model.mlp_bias = false "
                         f"(the experts are bias-free SwiGLUs), got mlp = {cfg.mlp!r}, mlp_bias = {cfg.mlp_bias}")
    bad = [i for i in cfg.moe_dense_layers if not isinstance(i, int) or not 0 <= i < cfg.n_layer]
    if bad:
        raise ValueError(f"model.moe_dense_layers holds {bad}: layer indices must be in 0..{cfg.n_layer - 1}")
    if not any(cfg.moe_layer(i) for i in range(cfg.n_layer)):
        raise ValueError(f"model.n_experts = {cfg.n_experts} but no layer is MoE (moe_first_dense = "
                         f"{cfg.moe_first_dense}, moe_every = {cfg.moe_every}, moe_dense_layers = "
                         f"{list(cfg.moe_dense_layers)}); set n_experts = 0 for a dense model")
    if cfg.moe_router not in MOE_ROUTERS:
        raise ValueError(f"model.moe_router = {cfg.moe_router!r} is invalid; valid: "
                         f"{', '.join(repr(v) for v in MOE_ROUTERS)}")
    _check_sigmoid_bias(cfg)
    if cfg.moe_aux_loss_scope not in MOE_AUX_SCOPES:
        raise ValueError(f"model.moe_aux_loss_scope = {cfg.moe_aux_loss_scope!r} is invalid; valid: "
                         f"{', '.join(repr(v) for v in MOE_AUX_SCOPES)}")
    if cfg.moe_experts_impl not in MOE_EXPERT_IMPLS:
        raise ValueError(f"model.moe_experts_impl = {cfg.moe_experts_impl!r} is invalid; valid: "
                         f"{', '.join(repr(v) for v in MOE_EXPERT_IMPLS)}")
    for field in ("moe_norm_topk_prob", "moe_shared_gate"):
        if not isinstance(getattr(cfg, field), bool):
            raise ValueError(f"model.{field} = {getattr(cfg, field)!r} is invalid: it must be true or false")
    if cfg.moe_shared_gate and not cfg.moe_shared_experts:
        raise ValueError("model.moe_shared_gate = true needs model.moe_shared_experts >= 1")
    for field in ("moe_aux_loss_coef", "moe_z_loss_coef", "moe_capacity_factor"):
        value = getattr(cfg, field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"model.{field} = {value!r} is invalid: it must be a number >= 0")

def _check_sigmoid_bias(cfg: ModelConfig) -> None:
    for field in ("moe_n_group", "moe_topk_group"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model.{field} = {value!r} is invalid: it must be a positive integer")
    for field in ("moe_routed_scaling_factor", "moe_bias_update_rate", "moe_seq_aux_loss_coef"):
        value = getattr(cfg, field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"model.{field} = {value!r} is invalid: it must be a number >= 0")
    if cfg.moe_router != "sigmoid_bias":  # softmax: the groups and the scale too (DeepSeek-V2), not the rest
        changed = [f for f, default in (("moe_bias_update_rate", 0.0), ("moe_seq_aux_loss_coef", 0.0),
                                        ("moe_nodes", 1), ("moe_max_nodes", 0))
                   if getattr(cfg, f) != default]
        if changed:
            raise ValueError(f"model.{', model.'.join(changed)} set but model.moe_router = {cfg.moe_router!r}: "
                             "they belong to moe_router = 'sigmoid_bias'")
    elif cfg.moe_seq_aux_loss_coef and cfg.moe_aux_loss_scope != "model":
        raise ValueError("model.moe_seq_aux_loss_coef needs model.moe_aux_loss_scope = 'model' (the layer scope's "
                         f"injection is not built for it), got {cfg.moe_aux_loss_scope!r}")
    n, g, e = cfg.moe_n_group, cfg.moe_topk_group, cfg.n_experts
    if e % n or (n > 1 and e // n < 2):
        raise ValueError(f"model.moe_n_group = {n} must divide model.n_experts = {e} into groups of 2 or more "
                         f"experts; valid: {[d for d in range(1, e + 1) if e % d == 0 and (d == 1 or e // d >= 2)]}")
    if g > n:
        raise ValueError(f"model.moe_topk_group = {g} is larger than model.moe_n_group = {n}; valid: 1..{n}")
    if cfg.moe_top_k > g * (e // n):
        raise ValueError(f"model.moe_top_k = {cfg.moe_top_k} is more than the {g * (e // n)} experts of "
                         f"model.moe_topk_group = {g} groups of {e // n}; valid: 1..{g * (e // n)}")
    if cfg.moe_router == "sigmoid_bias":
        check_node_limit(cfg)


# The fields that change parameter shapes or names: two configs that differ in one of them cannot share weights.
ARCHITECTURE_FIELDS = ("n_layer", "n_head", "d_model", "d_ff", "vocab_size", "n_positions", "n_kv_head", "norm",
                       "positions", "mlp", "tie_embeddings", "qkv_bias", "proj_bias", "mlp_bias", "head_width",
                       "qk_norm", "n_experts", "moe_d_ff", "moe_shared_experts", "moe_shared_d_ff",
                       "moe_shared_gate", "moe_first_dense", "moe_every", "moe_dense_layers", "moe_router",
                       "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_depth")
# Fields added after checkpoints already existed: a checkpoint that does not record one has the default (GPT-2's).
_LATER_FIELDS = {"norm": "layernorm", "positions": "learned", "mlp": "gelu", "tie_embeddings": True,
                 "qkv_bias": True, "proj_bias": True, "mlp_bias": True, "qk_norm": False, "n_experts": 0,
                 "moe_shared_experts": 0, "moe_shared_gate": False, "moe_first_dense": 0, "moe_every": 1,
                 "moe_dense_layers": (), "moe_router": "softmax", "kv_lora_rank": 0, "q_lora_rank": 0,
                 "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0, "mtp_depth": 0}


def architecture_mismatches(saved: dict, mine: dict) -> list[str]:
    """One message per architecture field in which two `dataclasses.asdict(ModelConfig)` dicts differ, e.g.
    "model.n_layer = 2 there, 12 here" (`saved`: a checkpoint's config, `mine`: the model about to load it)."""
    missing = "(not recorded)"

    def value(config: dict, field: str):
        if field == "n_kv_head" and not config.get(field):  # not recorded (older checkpoints) or 0: n_head
            return config.get("n_head", missing)
        if field == "head_width":  # reported only where the heads do not fill d_model (else n_head / d_model say it)
            d, n = config.get("d_model", 0), max(config.get("n_head", 1), 1)
            hd = config.get(field) or d // n  # 0 or not recorded (older checkpoints): the heads fill d_model
            return hd if hd * n != d else "d_model / n_head"
        if field.startswith("moe_") and not config.get("n_experts"):  # a dense model has no experts to shape
            return "(dense)"
        found = config.get(field, _LATER_FIELDS.get(field, missing))
        return tuple(found) if isinstance(found, list) else found

    return [f"model.{field} = {value(saved, field)} there, {value(mine, field)} here"
            for field in ARCHITECTURE_FIELDS if value(saved, field) != value(mine, field)]


def model_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]
