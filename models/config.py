"""ModelConfig and the preset registry.

Presets are frozen dataclass instances registered per model family (models/gpt2, models/turing_nlg). Nothing
switches behaviour on a preset's name: everything a model does follows from the fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of vocab_multiple * tp (so every tp shard is whole and aligned)."""
        multiple = self.vocab_multiple * tp
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self, vocab: int | None = None) -> int:
        """Exact parameter count by formula (tied embeddings counted once); `vocab` defaults to the true size."""
        d, f = self.d_model, self.d_ff
        vocab = self.vocab_size if vocab is None else vocab
        per_block = (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (2 * d) + (d * f + f) + (f * d + d)
        return vocab * d + self.n_positions * d + self.n_layer * per_block + 2 * d

    def replace(self, **changes) -> "ModelConfig":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown model field(s) {sorted(unknown)}; valid: {model_fields()}")
        if "d_model" in changes and "d_ff" not in changes and self.d_ff == 4 * self.d_model:
            changes["d_ff"] = 0  # the MLP width follows d_model (4x) unless it was set on its own
        return dataclasses.replace(self, **changes)


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
