"""The preset registry: every model family's frozen ModelConfigs by name (models/gpt2, models/turing_nlg,
models/llama, models/mixtral, models/qwen3 each hold their PRESETS; models/deepseek/presets.py). It sits above models/config.py and the families, which import only the config,
so nothing imports back.
"""

from __future__ import annotations

from megazoo.models import gpt2, llama, mixtral, qwen3, turing_nlg
from megazoo.models.config import ModelConfig
from megazoo.models.deepseek.presets import PRESETS as DEEPSEEK


def presets() -> dict[str, ModelConfig]:
    """Every registered preset, by name."""
    registry: dict[str, ModelConfig] = {}
    for family in (gpt2.PRESETS, turing_nlg.PRESETS, llama.PRESETS, mixtral.PRESETS, qwen3.PRESETS, DEEPSEEK):
        for cfg in family:
            assert cfg.name not in registry, f"preset {cfg.name} registered twice"
            registry[cfg.name] = cfg
    return registry


def get_preset(name: str) -> ModelConfig:
    registry = presets()
    if name not in registry:
        raise ValueError(f"model.preset = {name!r} is not a known preset; valid: {', '.join(registry)}")
    return registry[name]
