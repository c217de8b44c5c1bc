"""Run a verify plan's two trainings and hold the layout's numbers to the reference's.

The layout runs as forked gloo ranks on this machine (workers/local.py's run_distributed), the reference in this
process; both through the real Trainer, so what is compared is what `megazoo train` would run. Every rank's
losses, gradient norms, validation loss and full parameters are compared (ranks hold copies of the scalars and
gather the parameters, so a rank with its own view of the model is caught too).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.loss_scaler import DynamicLossScaler
from megazoo.recipes.resolve import Resolved
from megazoo.recipes.training.trainer import Trainer
from megazoo.recipes.verify.precision import TOLERANCES, Tolerances
from megazoo.recipes.verify.shrink import VerifyPlan
from megazoo.workers.local import run_distributed

TOLERANCE = 1e-10  # fp64: layouts that compute the same function differ by reduction order, ~1e-15


@dataclass
class Quantity:
    name: str  # "loss", "gradient norm", "validation loss", "parameters"
    how: str  # "relative, per step" | "absolute, per element"
    deviation: float  # the largest over steps (elements) and ranks; inf when something is missing or non-finite
    tolerance: float = TOLERANCE
    worst: str = ""  # where the largest deviation is (step, rank, parameter)
    rows: list[tuple] = field(default_factory=list)  # per step: (step, reference, layout on rank 0, deviation)

    @property
    def passed(self) -> bool:
        return self.deviation <= self.tolerance


def _train(res: Resolved, topo: Topology, loss_scaling: bool) -> dict:
    trainer = Trainer(res, topo)
    if loss_scaling:  # the recipe's fp16 loss scaling, run in fp64: a power-of-two scale is exact there
        ls = res.recipe.loss_scale
        trainer.scaler = DynamicLossScaler(ls.initial_scale, ls.growth_interval, ls.hysteresis, ls.min_scale)
    result = trainer.fit()
    return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
            "params": trainer.full_state_dict()}


def _rank_train(res: Resolved, loss_scaling: bool) -> dict:
    """One rank of a multi-process run (module level: spawned GPU ranks unpickle it)."""
    return _train(res, Topology.of(res.recipe.parallel), loss_scaling)  # the recipe's nodes (HSDP / hpZ)


def _layout_ranks(res: Resolved, loss_scaling: bool, device: str = "cpu") -> list[dict]:
    par = res.recipe.parallel
    if res.world_size == 1:
        return [_train(res, Topology.solo(torch.device(device)), loss_scaling)]
    # Collective fingerprints on (parallel/collective_check.py): a layout whose ranks call different collectives
    # fails at once with both calls named, instead of hanging until the timeout. On CUDA the ranks are spawned
    # (a forked child cannot use its parent's CUDA context) and rank r runs on GPU r with NCCL.
    gpu = {"start_method": "spawn", "device": None} if device == "cuda" else {}
    return run_distributed(_rank_train, res.world_size, res, loss_scaling, timeout_s=par.timeout_s,
                           check_collectives=True, **gpu)


def _relative(a: float | None, b: float | None) -> float:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-300)


def _per_step(name: str, key: str, ref: dict, ranks: list[dict], tolerance: float = TOLERANCE) -> Quantity:
    q = Quantity(name, "relative, per step", 0.0, tolerance)
    for step, expected in enumerate(ref[key]):
        devs = [_relative(r[key][step] if step < len(r[key]) else None, expected) for r in ranks]
        worst = max(range(len(devs)), key=devs.__getitem__)
        q.rows.append((step, expected, ranks[0][key][step] if step < len(ranks[0][key]) else None, devs[worst]))
        if devs[worst] > q.deviation or step == 0:
            q.deviation, q.worst = max(q.deviation, devs[worst]), f"step {step}, rank {worst}"
    return q


def _parameters(ref: dict, ranks: list[dict], tolerance: float = TOLERANCE) -> Quantity:
    q = Quantity("parameters (final, full)", "absolute, per element", 0.0, tolerance)
    for rank, got in enumerate(ranks):
        missing = sorted(set(ref["params"]) ^ set(got["params"]))
        if missing:
            return Quantity(q.name, q.how, math.inf, tolerance,
                            worst=f"rank {rank}: names differ: {', '.join(missing[:4])}")
        for name, expected in ref["params"].items():
            value = got["params"][name]
            if value.shape != expected.shape:
                return Quantity(q.name, q.how, math.inf, tolerance,
                                worst=f"rank {rank}: {name} has shape {tuple(value.shape)}, not {tuple(expected.shape)}")
            diff = (value.double() - expected.double()).abs().max().item()
            diff = diff if math.isfinite(diff) else math.inf
            if diff > q.deviation or not q.worst:
                q.deviation, q.worst = diff, f"{name}, rank {rank}"
    return q


def compare(ref: dict, ranks: list[dict], tolerances: Tolerances = TOLERANCES["fp64"]) -> list[Quantity]:
    val = Quantity("validation loss (after the last step)", "relative", max(_relative(r["val"], ref["val"])
                                                                           for r in ranks), tolerances.val_loss)
    return [_per_step("loss", "losses", ref, ranks, tolerances.loss),
            _per_step("gradient norm (before clipping)", "norms", ref, ranks, tolerances.grad_norm),
            val, _parameters(ref, ranks, tolerances.parameters)]


@dataclass
class Outcome:
    quantities: list[Quantity]
    reference_s: float
    layout_s: float

    @property
    def passed(self) -> bool:
        return all(q.passed for q in self.quantities)


def run(plan: VerifyPlan) -> Outcome:
    """Train the reference here, then the layout on its ranks; compare. Raises RuntimeError (naming the rank and
    its traceback) when a layout rank fails."""
    start, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as each forked rank has
    try:
        ref = _layout_ranks(plan.reference, False, plan.device)[0]  # its dp ranks hold the same model
        middle = time.perf_counter()
        ranks = _layout_ranks(plan.layout, plan.loss_scaling, plan.device)
        end = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    return Outcome(compare(ref, ranks, plan.tolerances), middle - start, end - middle)
