"""Model states of a LoRA run: the frozen base weights are stored (partitioned under ZeRO-3) but have no gradient
and no optimizer state; the adapters hold the full set (recipes/planner/zero.py's megazoo_state_memory).

    params      s x frozen (/ N at stage 3) + the adapters' params
    grads       the adapters' only
    optimizer   the adapters' only (fp32 masters where s != m, Adam moments)

s is the storage bytes of a parameter (storage_bytes: fp32 under ZeRO-0's autocast, 2 bytes for bf16/fp16 from
ZeRO-1), N = dp x cp. Equal to the real optimizers' memory_bytes() (tests/recipes/planner/test_lora_planner.py).
"""

from __future__ import annotations

from dataclasses import replace

from megazoo.models.config import ModelConfig
from megazoo.models.lora.config import LoRAConfig, adapter_parameters
from megazoo.recipes.planner.zero import ModelStateMemory, megazoo_state_memory, storage_bytes


def lora_state_memory(frozen: int, trainable: int, dp: int, stage: int, precision: str = "bf16", *,
                      offload: bool = False) -> ModelStateMemory:
    """Per-rank model states of `frozen` base parameters and `trainable` adapter parameters at ZeRO `stage`."""
    adapters = megazoo_state_memory(trainable, dp, stage, precision, offload=offload)
    base = storage_bytes(stage, precision) * frozen / (dp if stage == 3 else 1)
    return replace(adapters, psi=frozen + trainable, params_bytes=adapters.params_bytes + base)


def stage_adapters(cfg: ModelConfig, lora: LoRAConfig, tp: int, blocks: int) -> int:
    """Adapter parameters of a pipeline stage of `blocks` blocks on one tp rank."""
    return adapter_parameters(cfg, lora, tp) * blocks
