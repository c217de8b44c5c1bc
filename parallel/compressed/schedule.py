"""Which kind of step an optimizer step is: the policies of 1-bit Adam and 0/1 Adam, as pure functions of the step.

Steps are counted from 0 (optimizer steps taken before this one). Every rank derives the same answer from the
step number alone (no host read, no collective), before the step's backward: the gradient hooks must know
whether to all-reduce.

| kind          | optimizer      | gradients                           | state update                      | sends           |
|---------------|----------------|-------------------------------------|-----------------------------------|-----------------|
| "adamw"       | both, warm-up  | all-reduce (full precision)         | AdamW (the kernels' op)           | 2 x 4 n         |
| "onebit"      | onebit_adam    | local                               | m from local g, then m compressed | ~2 n / 8        |
| "var"         | zero_one_adam  | all-reduce (full precision)         | m and v                           | 2 x 4 n         |
| "onebit_grad" | zero_one_adam  | compressed all-reduce               | m only (v as of the last "var")   | ~2 n / 8        |
| "local"       | zero_one_adam  | local                               | m, local parameter step           | 0               |
| "sync"        | zero_one_adam  | local                               | local step, then the accumulated  | ~2 n / 8        |
|               |                |                                     | update compressed, m re-estimated |                 |

1-bit Adam: "adamw" for steps < freeze_step, then "onebit" (variance frozen at freeze_step).
0/1 Adam: "adamw" for steps < freeze_step; then, until var_freeze_step, the variance is updated on exponentially
spaced "var" steps (interval 2 after the warm-up, doubled every var_update_scaler updates: the paper's kappa) and
the other steps compress the gradient; from var_freeze_step the variance is frozen and ranks take "local" steps,
synchronising every local interval ("sync"): 1, doubled every local_step_scaler steps, at most local_step_clipper
(the paper's H). The last training step (if known) is always a "sync", so a run ends with identical replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZERS = ("adamw", "onebit_adam", "zero_one_adam")
COMPRESSED = OPTIMIZERS[1:]


@dataclass(frozen=True)
class CompressionSettings:
    """The recipe's [optimizer] for the compressed variants (AdamW's lr, betas, eps, decay come separately)."""

    name: str = "onebit_adam"  # "onebit_adam" | "zero_one_adam"
    freeze_step: int = 100  # AdamW steps (full-precision all-reduce) before compression starts; >= 1
    var_freeze_step: int = 1000  # zero_one_adam: from this step on the variance is frozen and local steps start
    var_update_scaler: int = 16  # zero_one_adam: variance updates per interval before the interval doubles
    local_step_scaler: int = 1000  # zero_one_adam: steps before the local-step interval doubles
    local_step_clipper: int = 16  # zero_one_adam: the largest local-step interval
    last_step: int | None = None  # the run's last step (train.steps - 1): 0/1 Adam synchronises there


def check_settings(s: CompressionSettings, *, dp: int, tp: int, pp: int, zero_stage: int, offload: str) -> None:
    """Raise ValueError naming the [optimizer] (or other) field, its value and what is valid."""
    if s.name not in COMPRESSED:
        raise ValueError(f"optimizer.name = {s.name!r} is invalid; valid: {', '.join(map(repr, OPTIMIZERS))}")
    if zero_stage not in (0, 1):
        raise ValueError(f"optimizer.name = {s.name!r} needs zero.stage = 0 or 1 (every rank compresses its full "
                         f"local momentum or gradient, so gradients cannot be partitioned as stages 2-3 do), got "
                         f"zero.stage = {zero_stage}; valid: zero.stage = 0 or 1, or optimizer.name = 'adamw'")
    if offload != "none":
        raise ValueError(f"optimizer.name = {s.name!r} does not run with zero.offload = {offload!r}; valid: 'none'")
    if pp != 1:
        raise ValueError(f"optimizer.name = {s.name!r} with parallel.pp = {pp} is not supported (the tied "
                         "embedding's pipeline all-reduce is not compressed); valid: parallel.pp = 1")
    if s.freeze_step < 1:
        raise ValueError(f"optimizer.freeze_step = {s.freeze_step} is invalid: the variance needs at least one "
                         "AdamW step before it is frozen; valid: >= 1")
    if s.name == "zero_one_adam":
        if s.var_freeze_step < s.freeze_step:
            raise ValueError(f"optimizer.var_freeze_step = {s.var_freeze_step} is smaller than optimizer."
                             f"freeze_step = {s.freeze_step}; valid: >= {s.freeze_step}")
        for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            if getattr(s, key) < 1:
                raise ValueError(f"optimizer.{key} = {getattr(s, key)} is invalid; valid: >= 1")
    del dp, tp  # any dp (one rank runs the same arithmetic without collectives) and any tp compose


class Schedule:
    """kind(step) and var_updates(step) for one CompressionSettings; 0/1 Adam's local policy is cached."""

    def __init__(self, s: CompressionSettings):
        self.s = s
        self._var_steps: set[int] = set()
        if s.name == "zero_one_adam":
            step, interval, count = s.freeze_step - 1, 2, 0  # the warm-up's last step updated the variance
            while True:
                step += interval
                if step >= s.var_freeze_step:
                    break
                self._var_steps.add(step)
                count += 1
                if count == s.var_update_scaler:
                    count, interval = 0, interval * 2
        self._syncs: list[bool] = []  # phase "local": whether step var_freeze_step + i synchronises
        self._local = (1, 0, 0)  # (interval, steps since the last sync, steps since the interval changed)

    def kind(self, step: int) -> str:
        s = self.s
        if step < s.freeze_step:
            return "adamw"
        if s.name == "onebit_adam":
            return "onebit"
        if step < s.var_freeze_step:
            return "var" if step in self._var_steps else "onebit_grad"
        if step == s.last_step:
            return "sync"
        return "sync" if self._sync_at(step - s.var_freeze_step) else "local"

    def _sync_at(self, i: int) -> bool:
        while len(self._syncs) <= i:
            interval, since, count = self._local
            since += 1
            sync = since >= interval
            since = 0 if sync else since
            count += 1
            if count == self.s.local_step_scaler:
                count, interval = 0, min(self.s.local_step_clipper, interval * 2)
            self._syncs.append(sync)
            self._local = (interval, since, count)
        return self._syncs[i]

    def var_updates(self, step: int) -> int:
        """How many times the variance has been updated once `step` is done (its bias correction)."""
        s = self.s
        if step < s.freeze_step or s.name == "onebit_adam":
            return min(step + 1, s.freeze_step)
        return s.freeze_step + sum(1 for v in self._var_steps if v <= step)

    def full_precision(self, step: int) -> bool:
        """Whether this step's gradients are all-reduced in full precision by the backward hooks."""
        return self.kind(step) in ("adamw", "var")
