"""ModelConfig and the preset registry.

Presets are frozen dataclass instances registered per model family (models/gpt2, models/turing_nlg). Nothing
switches behaviour on a preset's name: everything a model does follows from the fields. The parameters those
fields imply (names, shapes, tp splits) and the (tp, pp) layouts they admit are described in models/layout.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
    rope_original_positions: int = 8192  # llama3: the context the model was pretrained at
    # Block-sparse attention (models/sparse_attention.py): no weights, so none of these is an architecture field.
    attention: str = "dense"  # "dense" | "sparse"
    sparse_pattern: str = "fixed"  # "fixed" | "bigbird" | "sliding_window"
    sparse_block: int = 16  # tokens per block
    sparse_local_blocks: int = 4  # fixed: blocks per window; bigbird / sliding_window: the window, itself included
    sparse_global_blocks: int = 1  # fixed: summary blocks at the end of each window; bigbird: the first blocks
    sparse_random_blocks: int = 1  # bigbird: random earlier blocks per query block
    sparse_seed: int = 0  # bigbird: the random blocks' seed (the same pattern in every layer and run)

    def __post_init__(self):
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.n_kv_head == 0:
            object.__setattr__(self, "n_kv_head", self.n_head)
        for field in ("n_layer", "n_head", "d_model", "n_positions", "vocab_size", "d_ff", "vocab_multiple",
                      "n_kv_head"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{field} = {value!r} is invalid: it must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model = {self.d_model} is not divisible by model.n_head = {self.n_head}")
        for field in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"model.{field} = {getattr(self, field)} must be in [0, 1)")
        self._check_architecture()
        self._check_sparse()

    def _check_architecture(self) -> None:
        for field, valid in (("norm", NORMS), ("positions", POSITIONS), ("mlp", MLPS), ("rope_scaling", ROPE_SCALINGS)):
            if getattr(self, field) not in valid:
                raise ValueError(f"model.{field} = {getattr(self, field)!r} is invalid; valid: "
                                 f"{', '.join(repr(v) for v in valid)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_kv_head = {self.n_kv_head} does not divide model.n_head = {self.n_head}; "
                             f"valid: {[k for k in range(1, self.n_head + 1) if self.n_head % k == 0]}")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"model.positions = 'rotary' needs an even head dimension, got d_model / n_head = "
                             f"{self.head_dim}")
        for field in ("tie_embeddings", "qkv_bias", "proj_bias", "mlp_bias"):
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
        return self.d_model // self.n_head

    @property
    def fused_qkv(self) -> bool:
        """Multi-head attention keeps GPT-2's fused [Q; K; V] projection (attn.c_attn); grouped-query attention
        has attn.c_q and attn.c_kv ([K; V], n_kv_head heads each), so K/V can be replicated where tp > n_kv_head."""
        return self.n_kv_head == self.n_head

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
        return dataclasses.replace(self, **changes)


NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
MLPS = ("gelu", "swiglu")
ROPE_SCALINGS = ("none", "llama3")

# The fields that change parameter shapes or names: two configs that differ in one of them cannot share weights.
ARCHITECTURE_FIELDS = ("n_layer", "n_head", "d_model", "d_ff", "vocab_size", "n_positions", "n_kv_head", "norm",
                       "positions", "mlp", "tie_embeddings", "qkv_bias", "proj_bias", "mlp_bias")
# Fields added after checkpoints already existed: a checkpoint that does not record one has the default (GPT-2's).
_LATER_FIELDS = {"norm": "layernorm", "positions": "learned", "mlp": "gelu", "tie_embeddings": True,
                 "qkv_bias": True, "proj_bias": True, "mlp_bias": True}


def architecture_mismatches(saved: dict, mine: dict) -> list[str]:
    """One message per architecture field in which two `dataclasses.asdict(ModelConfig)` dicts differ, e.g.
    "model.n_layer = 2 there, 12 here" (`saved`: a checkpoint's config, `mine`: the model about to load it)."""
    missing = "(not recorded)"

    def value(config: dict, field: str):
        if field == "n_kv_head" and not config.get(field):  # not recorded (older checkpoints) or 0: n_head
            return config.get("n_head", missing)
        return config.get(field, _LATER_FIELDS.get(field, missing))

    return [f"model.{field} = {value(saved, field)} there, {value(mine, field)} here"
            for field in ARCHITECTURE_FIELDS if value(saved, field) != value(mine, field)]


def model_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]
