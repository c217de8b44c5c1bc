"""`megazoo convert megazoo-to-hf` of a LoRA run's checkpoint: `--merge-lora` (adapters folded into the base:
a plain HF model) or `--peft-adapter` (the adapter alone in PEFT's format, models/lora/peft_interop.py).

A LoRA run's checkpoints hold only the adapters (recipes/training/lora_setup.py); the base is the checkpoint its
recipe loaded (`checkpoint.load`, recorded in the checkpoint's common.json), or `--lora-base`.
"""

from __future__ import annotations

from pathlib import Path

from megazoo.models.config import ModelConfig
from megazoo.models.lora.adapters import LoRAConfig, merge_lora


def lora_of_checkpoint(common: dict) -> LoRAConfig | None:
    """The `[lora]` a checkpoint was trained with (its common.json's recipe), or None for full fine-tuning."""
    table = (common.get("recipe") or {}).get("lora") or {}
    if not table.get("rank"):
        return None
    return LoRAConfig(**{**table, "targets": tuple(table.get("targets", ()))})


def lora_checkpoint(checkpoint: str | Path) -> tuple[dict, LoRAConfig | None]:
    from megazoo.parallel.checkpoint.consolidate import read_common, resolve_checkpoint

    common = read_common(resolve_checkpoint(checkpoint, report=lambda *_: None))
    return common, lora_of_checkpoint(common)


def _full_state(checkpoint: str | Path) -> tuple[ModelConfig, dict]:
    """(ModelConfig, full fp32 state) of a checkpoint of any layout (parallel/checkpoint/consolidate.py)."""
    from megazoo.parallel.checkpoint.consolidate import read_full_state

    model, state = read_full_state(checkpoint)
    return ModelConfig(**model), state


def merged_state(checkpoint: str | Path, base: str | Path | None = None):
    """(cfg, full state with the adapters merged, LoRA settings, adapters' full state) of a LoRA checkpoint."""
    common, lora = lora_checkpoint(checkpoint)
    if lora is None:
        raise ValueError(f"checkpoint {checkpoint} was not trained with LoRA (its recipe has no [lora] rank): "
                         "export it without --merge-lora / --peft-adapter")
    base = base or (common.get("recipe") or {}).get("checkpoint", {}).get("load")
    if not base:
        raise ValueError(f"checkpoint {checkpoint}: its recipe names no checkpoint.load (the LoRA base); pass "
                         "--lora-base CKPT")
    cfg, adapters = _full_state(checkpoint)
    base_cfg, base_state = _full_state(base)
    if base_cfg.n_layer != cfg.n_layer or base_cfg.d_model != cfg.d_model:
        raise ValueError(f"LoRA base {base} is model {base_cfg.name}, the adapters' is {cfg.name}")
    return cfg, merge_lora({**base_state, **adapters}, cfg, lora), lora, adapters


def export_lora(checkpoint: str | Path, staging: Path, *, merge: bool, base: str | Path | None,
                tokenizer=None) -> tuple[ModelConfig, str]:
    """Write the merged HF model (merge) or the PEFT adapter into `staging`; returns (cfg, what was written)."""
    if not merge:
        from megazoo.models.lora.peft_interop import write_peft_adapter

        common, lora = lora_checkpoint(checkpoint)
        if lora is None:
            raise ValueError(f"checkpoint {checkpoint} was not trained with LoRA: it has no adapter to export")
        cfg, adapters = _full_state(checkpoint)
        write_peft_adapter(staging, adapters, cfg, lora)
        return cfg, "PEFT LoRA adapter"
    cfg, full, _, _ = merged_state(checkpoint, base)
    if cfg.positions == "learned":
        from megazoo.models.hf.gpt2 import export_hf_dir
        family = "GPT-2"
    elif cfg.n_experts or cfg.qk_norm:  # Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3
        from megazoo.models.hf.moe_families import export_hf_dir, hf_family
        family = hf_family(cfg)
    else:
        from megazoo.models.hf.llama import export_hf_dir, hf_family
        family = hf_family(cfg)
    export_hf_dir(full, cfg, staging, tokenizer=tokenizer)
    return cfg, f"HF {family} directory (LoRA merged)"
