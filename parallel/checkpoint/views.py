"""What a rank owns, as flat views into live storage: the one description both saving and loading use.

A `StateView` names a global parameter, its tensor-parallel layout (ShardSpec), the kind of state ("param",
"master" (fp32 master weights), "exp_avg", "exp_avg_sq") and a flat element range [start, stop) of the
*tp-local* tensor, with a 1-D view of exactly those elements in this rank's memory. ZeRO chunks cut parameters
at arbitrary element offsets, so ranges, not whole tensors, are the unit. Because every view is expressed in
global terms (name + tp layout + range), a checkpoint can be loaded into any other (dp, tp, pp, ZeRO) layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazoo.parallel.tensor import ShardSpec

STATE_KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


@dataclass
class StateView:
    name: str
    spec: ShardSpec
    kind: str
    start: int
    stop: int
    tensor: torch.Tensor  # 1-D, stop - start elements, aliasing live storage
    write: bool = True  # False: another rank writes the same values (replicas over dp)


def ensure_adam_state(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> None:
    """Create AdamW's lazily-initialised state (zero moments, step 0) so it can be loaded into."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")  # step lives with t
    for t in tensors:
        if t not in optimizer.state or not optimizer.state[t]:
            step = torch.zeros((), device=t.device if on_device else "cpu")  # no host data: fake-CUDA safe
            optimizer.state[t] = {"step": step, "exp_avg": torch.zeros_like(t),
                                  "exp_avg_sq": torch.zeros_like(t)}


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """How many updates AdamW has applied (its bias correction depends on it). torch keeps the count per tensor
    in `state[p]["step"]`, apex's FusedAdam per group in `param_groups[i]["step"]`: the larger one is live."""
    counts = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    counts += [int(group["step"]) for group in optimizer.param_groups if "step" in group]
    return max(counts, default=0)


def set_optimizer_steps(optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Set the update count wherever the optimizer keeps it (see optimizer_steps): per tensor and per group."""
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].fill_(float(steps))
    for group in optimizer.param_groups:
        group["step"] = steps


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """`zero_grad(set_to_none=True)` for every optimizer: apex's FusedAdam.zero_grad takes no argument."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def whole_param_views(name: str, spec: ShardSpec, param: torch.Tensor, state: dict | None,
                      write: bool) -> list[StateView]:
    """Views of a parameter held whole (not dp-partitioned) and its Adam moments. (An fp32 "param" view loads
    from "master" pieces when the checkpoint has them: they are the precise values.)"""
    n = param.numel()
    views = [StateView(name, spec, "param", 0, n, param.detach().view(-1), write)]
    if state is not None:
        views += [StateView(name, spec, kind, 0, n, state[kind].view(-1), write) for kind in ("exp_avg", "exp_avg_sq")]
    return views
