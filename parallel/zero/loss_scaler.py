"""Dynamic loss scaling for fp16 training, with the overflow verdict agreed by every rank.

fp16 gradients underflow unless the loss is multiplied by a large scale before backward. The scale starts at
`initial_scale` (2^16); a step whose gradients hold an inf/NaN on ANY rank (dp, tp or pp) is skipped on every
rank, and after `hysteresis` such steps the scale is multiplied by `backoff` (never below `min_scale`). After
`growth_interval` good steps in a row the scale grows by `growth` and the hysteresis budget is restored.
(The rules are Megatron-LM's DynamicGradScaler's; DeepSpeed's loss_scale_window is our growth_interval.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist


@dataclass
class DynamicLossScaler:
    initial_scale: float = 2.0 ** 16
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    growth: float = 2.0
    backoff: float = 0.5

    def __post_init__(self):
        if self.initial_scale <= 0 or self.min_scale <= 0 or self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(f"invalid loss scaler settings: {self}")
        self.scale = float(self.initial_scale)
        self._good_steps = 0
        self._hysteresis_left = self.hysteresis

    @torch.no_grad()
    def unscale_and_check(self, grads: Iterable[torch.Tensor], device: torch.device) -> bool:
        """Divide `grads` by the scale in place and return True when any gradient on any rank of the job holds
        an inf/NaN (the gradients are then garbage: drop them). One fused kernel per (device, dtype) group
        checks and unscales (torch's AMP foreach op), and the verdict is read on the host once. Collective:
        all-reduce (max) over all ranks, so every rank takes the same decision (dp, tp and pp ranks hold
        different gradients)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            if g is not None:
                groups.setdefault((g.device, g.dtype), []).append(g)
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for (where, dtype), tensors in groups.items():
            found = torch.zeros(1, dtype=torch.float32, device=where)
            if dtype in (torch.float16, torch.bfloat16, torch.float32):
                inv_scale = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=where)
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale)
            else:  # fp64 (parity tests): the op takes no fp64 tensors
                found.fill_(float(not all(torch.isfinite(t).all() for t in tensors)))
                torch._foreach_mul_(tensors, 1.0 / self.scale)
            flag = torch.maximum(flag, found.to(device, non_blocking=True))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self._good_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
