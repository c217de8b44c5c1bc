"""ZeRO with expert parallelism: expert weights reduced and partitioned over their expert-data-parallel group
(parallel/zero/'s stages unchanged, each built twice).

Under expert parallelism (parallel/expert, Topology.ep) the dp x cp ranks of one (pp, tp) position no longer all
hold the same parameters: dense weights (attention, norms, router, shared experts, embeddings) are replicated over
all of them, but a routed expert's weights live only on the (dp x cp) / ep ranks with the same ep rank, the
expert-data-parallel group (Topology.edp_group). So the model's parameters are split in two and each half gets
the recipe's ZeRO stage over its own group:

  dense    the stage over grad_group, exactly as without experts
  experts  the same stage over edp_group: gradients reduce-scattered (stages 1-3) or all-reduced (stage 0) over
           edp, states partitioned over edp. The all-to-all already summed every ep rank's tokens into an
           expert's gradient, so the sum over edp covers all dp x cp ranks' tokens: it is divided by dp x cp (not
           by edp) to give the same mean as one process (Megatron's expert gradient scaling).

One step then runs both halves; the global norm adds the experts' squares (summed over edp, then over the ep
group, whose ranks hold different experts, then over pp) to the dense norm, and clipping scales both by the one
coefficient. Collectives beyond the dense stage's: the expert stage's own over edp, plus one all-reduce of a
scalar over ep and one over pp per step for the norm.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from megazoo.parallel.checkpoint.views import StateView
from megazoo.parallel.collectives import CommLedger
from megazoo.parallel.topology import Topology


def expert_topology(topo: Topology) -> Topology:
    """`topo` as the expert half's ZeRO sees it: the "data-parallel" ranks are the expert-data-parallel group
    (no cp split: its ranks are in edp), and no tp or pp group, so that half's norm is its own squares summed
    over edp only (ExpertSplitZero adds ep and pp)."""
    return dataclasses.replace(
        topo, dp=topo.edp, dp_rank=topo.edp_rank, dp_group=topo.edp_group, cp=1, cp_rank=0, cp_group=None,
        dp_cp_group=None, tp_group=None, pp_group=None, embedding_group=None, dp_per_node=0,
        dp_intra_group=topo.edp_group, dp_inter_group=None, ep=1, ep_group=None, edp_group=None)


class JointLedger:
    """Both halves' CommLedgers as one (what the Trainer resets and sums per step), and any others a caller adds
    (the MoE layers' dispatchers: their all-to-all bytes count in the step's traffic)."""

    def __init__(self, *ledgers: CommLedger):
        self.ledgers = list(ledgers)

    def reset(self) -> None:
        for ledger in self.ledgers:
            ledger.reset()

    def _merged(self, attribute: str) -> dict:
        out: dict = {}
        for ledger in self.ledgers:
            for kind, value in getattr(ledger, attribute).items():
                out[kind] = out.get(kind, 0) + value
        return out

    elements = property(lambda self: self._merged("elements"))
    bytes = property(lambda self: self._merged("bytes"))
    calls = property(lambda self: self._merged("calls"))
    link_bytes = property(lambda self: self._merged("link_bytes"))

    def summary(self) -> dict[str, float]:
        out = {f"{kind}_bytes": value for kind, value in sorted(self.bytes.items())}
        out["total_bytes"] = sum(self.bytes.values())
        return out


class _JointOptimizer:
    """The two halves' torch optimizers where the checkpoint reads and sets the update count (state, groups)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def defaults(self) -> dict:
        return self.optimizers[0].defaults


class ExpertSplitZero:
    """A ZeroOptimizer (interface.py) made of a dense half over grad_group and an expert half over edp_group."""

    def __init__(self, dense, experts, topo: Topology):
        """`experts` None: this pipeline stage holds no MoE layer (the dense half alone, the norm's collectives
        joined with a zero)."""
        self.dense, self.experts, self.topo = dense, experts, topo
        self.halves = (dense,) if experts is None else (dense, experts)
        self.optimizer = _JointOptimizer(*(half.optimizer for half in self.halves))
        self.comm = JointLedger(*(half.comm for half in self.halves))
        if hasattr(dense, "stage"):
            self.stage = dense.stage

    def begin_micro_batch(self, last: bool) -> None:
        for half in self.halves:
            half.begin_micro_batch(last)

    def finish_gradients(self) -> None:
        for half in self.halves:
            half.finish_gradients()

    def gradients(self) -> list[torch.Tensor]:
        return [g for half in self.halves for g in half.gradients()]

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        dense = self.dense.grad_norm()
        experts = (dense.new_zeros(1) if self.experts is None else  # summed over edp
                   self.experts.grad_norm().to(dense.dtype).square().reshape(1))
        for group in (self.topo.ep_group, self.topo.pp_group):  # ep ranks hold other experts; pp other layers
            if group is not None:
                dist.all_reduce(experts, group=group)
        return (dense.square() + experts[0]).sqrt()

    def clip_(self, total_norm: torch.Tensor, max_norm: float) -> None:
        for half in self.halves:
            half.clip_(total_norm, max_norm)

    def zero_grads_(self) -> None:
        for half in self.halves:
            half.zero_grads_()

    def step(self, lr: float) -> None:
        for half in self.halves:
            half.step(lr)

    @contextlib.contextmanager
    def gathered(self):
        with contextlib.ExitStack() as stack:
            for half in self.halves:
                stack.enter_context(half.gathered())
            yield

    def state_views(self) -> list[StateView]:
        return [view for half in self.halves for view in half.state_views()]

    def after_load(self) -> None:
        for half in self.halves:
            half.after_load()

    def memory_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for half in self.halves:
            for kind, value in half.memory_bytes().items():
                out[kind] = out.get(kind, 0) + value
        return out


def build_expert_split(build: Callable, stage: int, model: nn.Module, named: list, topo: Topology,
                       is_expert: Callable[[str], bool], **kwargs):
    """`build` (build.py's build_zero) twice: the dense parameters over grad_group and the ones `is_expert`
    names over edp_group (their gradient mean taken over all dp x cp ranks). `kwargs` go to both, except the
    tied parameters (never experts) to the dense half only."""
    dense_named = [entry for entry in named if not is_expert(entry[0])]
    expert_named = [entry for entry in named if is_expert(entry[0])]
    if not expert_named:  # a pipeline stage of dense layers only (DeepSeek's first 3): no expert half, but its
        # ranks still join the norm's ep and pp all-reduces that the stages holding experts run
        return ExpertSplitZero(build(stage, model, named, topo, **kwargs), None, topo)
    if not any(p.requires_grad for _, p, _ in expert_named):  # frozen experts (LoRA): nothing to reduce or step
        if stage == 3:  # stage 3 would partition them over dp x cp, whose ranks hold different experts
            raise ValueError("frozen experts (LoRA) with parallel.ep > 1 need zero.stage 0, 1 or 2 (got 3)")
        return build(stage, model, named, topo, **kwargs)  # held whole on their ep rank, in no bucket
    dense = build(stage, model, dense_named, topo, **kwargs)
    kwargs.pop("tied", None)
    experts = build(stage, model, expert_named, expert_topology(topo), **kwargs)
    # The expert half averaged over edp; the mean is over every dp x cp rank's tokens (module docstring).
    if hasattr(experts.reducer, "scale"):  # stages 1-3: GradientReducer multiplies the summed chunk by it
        experts.reducer.scale = 1.0 / topo.grad_size
    else:  # stage 0: GradientAllReducer divides the summed bucket by its divisor
        experts.reducer.divisor = topo.grad_size
    return ExpertSplitZero(dense, experts, topo)
