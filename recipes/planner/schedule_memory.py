"""A pipeline rank's activation peak, walked along its schedule's own action list (parallel/pipeline/schedules.py).

One owner for every schedule (GPipe, 1F1B, interleaved, ZB-H1, ZBV, DualPipeV): no closed form per schedule; the
planner replays the rank's list, the same list the engine runs, adding up what each (micro-batch, chunk) holds:

    F   + the chunk's forward bytes: its blocks' saved activations, the embedding / head extras and the stage's
          output (the engine keeps it until the backward starts from it)
    B   unsplit (no W follows): - the forward bytes (the whole backward frees the graph);
        split: - the forward bytes, + what W needs (split_backward.py's store: B releases the graph and keeps
          each linear's x and dY, (b, s, 16 h) per GPT block at tp 1, and the head's weight gradient; the first
          stage and checkpointed stages keep their graph and the arriving gradient instead)
    W   - what the split B left

During each B the chunk's backward workspace (one block's gradient temporaries, the loss's d logits) comes on top
of what is live: `peak` includes it, `held` does not. The counts of live (micro-batch, chunk) pairs at the held
peak come with it; under 1F1B the walk gives pp - rank, under GPipe m, under ZB-H1 pp on every rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from megazoo.parallel.pipeline.schedules import Action, schedule

# zbv's lists come from a greedy simulation whose cost grows with m^2; its peak is reached within the first
# few micro-batches per rank (at most 2 pp chunk-micro-batches in flight), so the planner walks a prefix of
# ZBV_DEPTH pp micro-batches (tests/recipes/planner/test_schedule_memory.py: the same peak as the whole list up to 8 pp).
ZBV_DEPTH = 4


@dataclass(frozen=True)
class ChunkBytes:
    """Bytes one micro-batch of one model chunk holds, by phase."""

    forward: float  # from its F to its B
    after_b: float  # from a split B to its W (instead of `forward`)
    workspace: float = 0.0  # transient, while its backward runs


@dataclass(frozen=True)
class Peak:
    held: float  # the most bytes held at once (saved activations + what waits for W)
    peak: float  # with the running backward's workspace on top
    live: int  # (micro-batch, chunk) pairs alive at the held peak (F ran, W - or the unsplit B - not yet)
    waiting_w: int  # of them between their B and their W


def actions(name: str, m: int, pp: int, rank: int, virtual: int = 1) -> list[Action]:
    """The rank's action list as the engine runs it; without a pipeline (pp 1) each micro-batch's forward and
    backward run back to back."""
    if pp == 1:
        return [a for i in range(m) for a in (("F", i, 0), ("B", i, 0))]
    if name == "zbv":
        m = min(m, ZBV_DEPTH * pp)
    return schedule(name, m, pp, rank, virtual)


@functools.lru_cache(maxsize=4096)
def _states(name: str, m: int, pp: int, rank: int, virtual: int) -> tuple[tuple, tuple]:
    """Every distinct moment of the rank's list, as per-chunk counts: (held: (forward, after_b) counts, live,
    waiting), and (during a B: counts before or after it, the chunk whose workspace runs). Bytes are linear in
    these counts, so a layout search evaluates a few moments instead of replaying the list each time."""
    steps = actions(name, m, pp, rank, virtual)
    n = max(c for _, _, c in steps) + 1
    split = {(i, c) for kind, i, c in steps if kind == "W"}
    fwd, aft = [0] * n, [0] * n
    live = waiting = 0
    held, during = set(), set()
    for kind, i, c in steps:
        before = (tuple(fwd), tuple(aft))
        if kind == "F":
            fwd[c] += 1
            live += 1
        elif kind == "B":
            fwd[c] -= 1
            if (i, c) in split:
                aft[c] += 1
                waiting += 1
            else:
                live -= 1
        else:
            aft[c] -= 1
            live -= 1
            waiting -= 1
        held.add((tuple(fwd), tuple(aft), live, waiting))
        if kind == "B":
            during |= {(*before, c), (tuple(fwd), tuple(aft), c)}
    return tuple(sorted(held)), tuple(sorted(during))


def rank_peak(name: str, m: int, pp: int, rank: int, virtual: int, chunks: Sequence[ChunkBytes]) -> Peak:
    """The rank's peak under `name` with m micro-batches, `chunks[c]` the bytes of its chunk c per micro-batch;
    the same as walk(actions(...), chunks)."""
    held, during = _states(name, m, pp, rank, virtual)

    def size(fwd, aft) -> float:
        return sum(f * chunk.forward + a * chunk.after_b for f, a, chunk in zip(fwd, aft, chunks))

    best = max(held, key=lambda st: (size(st[0], st[1]), -st[2]))
    top = max((size(f, a) + chunks[c].workspace for f, a, c in during), default=0.0)
    high = size(best[0], best[1])
    return Peak(high, max(high, top), best[2], best[3])


def walk(steps: Sequence[Action], chunks: Sequence[ChunkBytes]) -> Peak:
    """Replay `steps`, `chunks[c]` the bytes of chunk c per micro-batch."""
    split = {(i, c) for kind, i, c in steps if kind == "W"}
    now = best = top = 0.0
    live = waiting = best_live = best_waiting = 0
    for kind, i, c in steps:
        chunk = chunks[c]
        if kind == "F":
            now += chunk.forward
            live += 1
        elif kind == "B":
            before = now
            if (i, c) in split:
                now += chunk.after_b - chunk.forward
                waiting += 1
            else:
                now -= chunk.forward
                live -= 1
            top = max(top, max(before, now) + chunk.workspace)
        else:
            now -= chunk.after_b
            live -= 1
            waiting -= 1
        if now > best:
            best, best_live, best_waiting = now, live, waiting
    return Peak(best, max(best, top), best_live, best_waiting)


def peak_live(name: str, m: int, pp: int, rank: int, virtual: int = 1) -> int:
    """The most (micro-batch, chunk) pairs the rank holds at once (every chunk-micro-batch counted alike)."""
    return rank_peak(name, m, pp, rank, virtual, [ChunkBytes(1.0, 1.0)] * max(virtual, 1)).live


def _shape(name: str, m: int, pp: int, rank: int, virtual: int) -> tuple[float, int]:
    """The rank's held peak when a micro-batch waiting for W holds more than one before its B."""
    peak = rank_peak(name, m, pp, rank, virtual, [ChunkBytes(2.0, 3.0)] * max(virtual, 1))
    return peak.held, peak.live


def enough_micro_batches(name: str, m: int, pp: int, virtual: int = 1) -> int:
    """The fewest micro-batches (no more than m, a multiple of pp for the interleaved schedule, at least 2 pp - 1
    for DualPipeV) with which every rank reaches the same peak as with m - as many live chunk-micro-batches, as
    many of them waiting for W: what a dry run needs to run to meet the step's activation peak. GPipe: m."""
    if name == "gpipe" or pp == 1:
        return m if name == "gpipe" else 1
    want = [_shape(name, m, pp, r, virtual) for r in range(pp)]
    step = pp if name == "interleaved" else 1
    start = 2 * pp - 1 if name == "dualpipev" else step
    for k in range(start, m, step):
        if [_shape(name, k, pp, r, virtual) for r in range(pp)] == want:
            return k
    return m
