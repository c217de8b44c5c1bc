"""ModelConfig and the preset registry.

Presets are frozen dataclass instances registered per model family (models/gpt2, models/turing_nlg). Nothing
switches behaviour on a preset's name: everything a model does follows from the fields. The parameters those
fields imply (names, shapes, tp splits) and the (tp, pp) layouts they admit are described in models/layout.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megazoo.models.layout import parameter_layout


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-style decoder: pre-LayerNorm blocks, learned positions, tanh-GELU MLP, tied embeddings."""

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
        for field in ("n_layer", "n_head", "d_model", "n_positions", "vocab_size", "d_ff", "vocab_multiple"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{field} = {value!r} is invalid: it must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model = {self.d_model} is not divisible by model.n_head = {self.n_head}")
        for field in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"model.{field} = {getattr(self, field)} must be in [0, 1)")
        self._check_sparse()

    def _check_sparse(self) -> None:
        from megazoo.models.sparse_attention import PATTERNS
        if self.attention not in ("dense", "sparse"):
            raise ValueError(f"model.attention = {self.attention!r} is invalid; valid: 'dense', 'sparse'")
        if self.sparse_pattern not in PATTERNS:
            raise ValueError(f"model.sparse_pattern = {self.sparse_pattern!r} is invalid; valid: "
                             f"{', '.join(repr(p) for p in PATTERNS)}")
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
        return dataclasses.replace(self, **changes)


# The fields that change parameter shapes: two configs that differ in one of them cannot share weights.
ARCHITECTURE_FIELDS = ("n_layer", "n_head", "d_model", "d_ff", "vocab_size", "n_positions")


def architecture_mismatches(saved: dict, mine: dict) -> list[str]:
    """One message per architecture field in which two `dataclasses.asdict(ModelConfig)` dicts differ, e.g.
    "model.n_layer = 2 there, 12 here" (`saved`: a checkpoint's config, `mine`: the model about to load it)."""
    missing = "(not recorded)"
    return [f"model.{field} = {saved.get(field, missing)} there, {mine.get(field, missing)} here"
            for field in ARCHITECTURE_FIELDS if saved.get(field, missing) != mine.get(field, missing)]


def model_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]


def presets() -> dict[str, ModelConfig]:
    """Every registered preset, by name."""
    from megazoo.models import gpt2, turing_nlg  # the families register themselves

    registry: dict[str, ModelConfig] = {}
    for family in (gpt2.PRESETS, turing_nlg.PRESETS):
        for cfg in family:
            assert cfg.name not in registry, f"preset {cfg.name} registered twice"
            registry[cfg.name] = cfg
    return registry


def get_preset(name: str) -> ModelConfig:
    registry = presets()
    if name not in registry:
        raise ValueError(f"model.preset = {name!r} is not a known preset; valid: {', '.join(registry)}")
    return registry[name]
