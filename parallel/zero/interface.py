"""The one interface every ZeRO stage (0-3) implements, and the one optimizer step that drives it.

A training loop holds one `ZeroOptimizer` and never asks which stage it is:

  per micro-batch   begin_micro_batch(last) before its backward: stage 1 reduces gradients only in the last
                    backward; stages 2/3 reduce-scatter during every backward.
  per step          `optimizer_step(...)` below: finish_gradients (wait for the reductions) -> fp16 unscale and
                    overflow check (one fused op) -> global norm -> clip -> AdamW (+ all-gather, stages 1/2).
  full weights      `with zero.gathered():` every parameter is full on this rank (stage 3 gathers each unit,
                    then frees it again; a no-op below stage 3).

`optimizer_step` is the only place where unscale / clip / step / zero-grad happen: the Trainer
(recipes/training/trainer.py) and ZeroEngine (api.py) both call it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import ContextManager, Protocol, runtime_checkable

import torch

from megazoo.parallel.checkpoint.views import StateView
from megazoo.parallel.collectives import CommLedger
from megazoo.parallel.zero.loss_scaler import DynamicLossScaler


@runtime_checkable
class ZeroOptimizer(Protocol):
    """What stages 0 (DataParallelAdamW), 1-2 (ZeroStage12) and 3 (ZeroStage3) all provide."""

    optimizer: torch.optim.Optimizer  # the torch AdamW over what this rank owns (fp32 masters from stage 1)
    comm: CommLedger  # this rank's traffic, per collective kind

    def begin_micro_batch(self, last: bool) -> None: ...
    def finish_gradients(self) -> None: ...
    def gradients(self) -> list[torch.Tensor]: ...
    def grad_norm(self) -> torch.Tensor: ...
    def clip_(self, total_norm: torch.Tensor, max_norm: float) -> None: ...
    def zero_grads_(self) -> None: ...
    def step(self, lr: float) -> None: ...
    def gathered(self) -> ContextManager: ...
    def state_views(self) -> list[StateView]: ...
    def after_load(self) -> None: ...
    def memory_bytes(self) -> dict[str, int]: ...


class NothingToGather:
    """Mixin for stages 0-2: every rank already holds full parameters, so `gathered()` does nothing."""

    def gathered(self) -> ContextManager:
        return contextlib.nullcontext()


@runtime_checkable
class ReplicaSync(Protocol):
    """Replica groups beyond this job's dp (parallel/fault_tolerance/replica.py: torchft's quorum): the gradients
    are averaged over the live groups, then the groups vote whether the step commits."""

    def reduce_gradients(self, grads: list[torch.Tensor]) -> None: ...
    def should_commit(self) -> bool: ...


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: torch.Tensor  # the pre-clip global gradient norm (NaN when the step was skipped)
    skipped: bool  # fp16: the gradients overflowed on some rank, so no rank updated (or the step did not commit)
    loss_scale: float  # the scale this step's backward used (1.0 without a scaler)
    committed: bool = True  # False: replica groups failed during the step, nothing was updated (fault tolerance)
    # Host seconds this rank waited for the step's gradient reductions to finish (and, with replica groups, for the
    # groups' all-reduce and vote): a fast rank waits here for a slow one. On GPU the waits are on the stream, so
    # this counts only what the host waited.
    wait_s: float = 0.0


@torch.no_grad()
def optimizer_step(zero: ZeroOptimizer, *, lr: float, grad_clip: float, device: torch.device,
                   scaler: DynamicLossScaler | None = None, replicas: ReplicaSync | None = None) -> StepOutcome:
    """One optimizer step after the accumulation window's last backward.

    Under fp16 (`scaler`), a step whose gradients hold an inf/NaN on any rank is skipped on every rank
    (parameters untouched, gradients dropped) and the scaler backs off; otherwise the gradients are unscaled
    first. Collectives: the stage's outstanding reductions, one all-reduce (max) for the overflow verdict, the
    norm's all-reduces (dp, tp, pp), and the stage's all-gather of the updated parameters. With `replicas`
    (fault-tolerant replica groups) the stage's reduced gradients are then averaged over the live groups, and a
    step the groups do not commit changes nothing (its gradients are dropped).
    """
    start = time.perf_counter()
    zero.finish_gradients()
    scale = scaler.scale if scaler is not None else 1.0  # the scale this step's backward used
    if replicas is not None:
        replicas.reduce_gradients(zero.gradients())
        if not replicas.should_commit():
            zero.zero_grads_()
            return StepOutcome(torch.tensor(float("nan")), skipped=True, loss_scale=scale, committed=False,
                               wait_s=time.perf_counter() - start)
    wait_s = time.perf_counter() - start
    if scaler is not None:
        overflow = scaler.unscale_and_check(zero.gradients(), device)  # the step's one host read before metrics
        scaler.update(overflow)
        if overflow:  # every rank agreed: drop the step
            zero.zero_grads_()
            return StepOutcome(torch.tensor(float("nan")), skipped=True, loss_scale=scale, wait_s=wait_s)
    norm = zero.grad_norm()
    if grad_clip > 0:
        zero.clip_(norm, grad_clip)
    zero.step(lr)
    return StepOutcome(norm, skipped=False, loss_scale=scale, wait_s=wait_s)
