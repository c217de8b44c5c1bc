"""Stragglers: a rank persistently slower than its peers, named with its host and its time against the median.

Each step every rank knows its own compute time (the step's wall time minus what it waited for the gradient
reductions: parallel/zero/interface.StepOutcome.wait_s); the Trainer gathers them in the step's one metrics
all-reduce (one slot per rank), so this module only does arithmetic on the host values rank 0 already holds. A
slow rank shows as a long compute time and short waits, its peers as the opposite: the compute time is compared.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass, field

import torch.distributed as dist

from megazoo.parallel.fault_tolerance.config import FaultToleranceConfig
from megazoo.parallel.topology import Topology


@dataclass
class StragglerWatch:
    """Report rank r once its compute time has exceeded `factor` x the median of all ranks for `steps` steps in a
    row (once per streak; a step within the factor ends the streak)."""

    factor: float
    steps: int
    hosts: list[str]  # every rank's host name, gathered once
    streaks: dict[int, int] = field(default_factory=dict)

    def observe(self, step: int, compute_s: list[float]) -> list[str]:
        if len(compute_s) < 2 or self.factor <= 0:
            return []
        median = statistics.median(compute_s)
        reports = []
        for rank, seconds in enumerate(compute_s):
            if median > 0 and seconds > self.factor * median:
                self.streaks[rank] = self.streaks.get(rank, 0) + 1
                if self.streaks[rank] == self.steps:
                    host = self.hosts[rank] if rank < len(self.hosts) else "?"
                    reports.append(f"straggler: rank {rank} (host {host}) computed step {step} in {seconds:.3f} s, "
                                   f"{seconds / median:.1f}x the median {median:.3f} s of {len(compute_s)} ranks, for "
                                   f"{self.steps} steps in a row (fault_tolerance.straggler_factor = {self.factor:g})")
            else:
                self.streaks.pop(rank, None)
        return reports


def straggler_watch(ft: FaultToleranceConfig, topo: Topology) -> StragglerWatch | None:
    """The watch for `ft.straggler_factor` (None when off or alone). Collective when on: every rank's host name is
    gathered once, here, so that a report names it without a collective in the step."""
    if ft.straggler_factor <= 0 or topo.world_size == 1:
        return None
    hosts: list = [None] * topo.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return StragglerWatch(ft.straggler_factor, ft.straggler_steps, [str(h) for h in hosts])
