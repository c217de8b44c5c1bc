"""Times a schedule's action lists on an ideal pipeline: the theory the measured bubble is held against.

Each rank runs its list in order; an action starts when the rank is free and its inputs exist (F after the
previous stage's F of the same micro-batch, B after this stage's F and the next stage's B, W after this stage's
B), and takes `cost[kind]` (a B with no W of its own is the whole backward, B + W). Communication is free.
The bubble of a rank is the idle fraction of the whole schedule's span; `in_flight` counts micro-batches whose
forward ran and whose backward (its W, when split) has not: the activations a rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazoo.parallel.pipeline.zero_bubble import Action, stage_of


@dataclass(frozen=True)
class Timeline:
    span: float  # the schedule's makespan
    busy: tuple[float, ...]  # compute time per rank
    peak_in_flight: tuple[int, ...]  # per rank

    @property
    def bubble(self) -> float:  # mean idle fraction over ranks
        return 1.0 - sum(self.busy) / (len(self.busy) * self.span)


def simulate(lists: list[list[Action]], stages: int, placement: str = "loop",
             cost: dict[str, float] | None = None) -> Timeline:
    """Run every rank's list; raises ValueError on a deadlock, a repeated or missing action, or a dependency
    that no order could satisfy."""
    cost = cost or {"F": 1.0, "B": 1.0, "W": 1.0}
    pp = len(lists)
    split = {(r, a[1], a[2]) for r, actions in enumerate(lists) for a in actions if a[0] == "W"}
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    w_done: set[tuple[int, int]] = set()
    pc, free, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    live, peak = [0] * pp, [0] * pp
    while any(pc[r] < len(lists[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pc[r] < len(lists[r]):
                kind, i, c = lists[r][pc[r]]
                s = stage_of(c, pp, r, placement)
                if kind == "F":
                    deps = [] if s == 0 else [f_end.get((i, s - 1))]
                elif kind == "B":
                    deps = [f_end.get((i, s))] + ([] if s == stages - 1 else [b_end.get((i, s + 1))])
                else:
                    deps = [b_end.get((i, s))]
                if any(d is None for d in deps):
                    break
                start = max([free[r], *deps])
                took = cost["B"] + cost["W"] if kind == "B" and (r, i, c) not in split else cost[kind]
                free[r] = start + took
                busy[r] += took
                key = (i, s)
                table = {"F": f_end, "B": b_end}.get(kind)
                if (table is not None and key in table) or (kind == "W" and key in w_done):
                    raise ValueError(f"rank {r} runs {kind}{key} twice")
                if table is not None:
                    table[key] = free[r]
                else:
                    w_done.add(key)
                if kind == "F":
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                elif kind == "W" or (r, i, c) not in split:
                    live[r] -= 1
                pc[r] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule deadlocks: every rank waits at {[lists[r][pc[r]] for r in range(pp)]}")
    m = len({k[0] for k in f_end})
    every = {(i, s) for i in range(m) for s in range(stages)}
    if set(f_end) != every or set(b_end) != every:
        raise ValueError("some forward or backward is missing")
    if w_done != {(i, stage_of(c, pp, r, placement)) for r, i, c in split}:  # a W for each split B, once
        raise ValueError("some weight gradient is missing")
    return Timeline(max(free), tuple(busy), tuple(peak))
