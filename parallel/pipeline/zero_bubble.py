"""Zero-bubble schedules (Qi et al. 2024): every backward split into B and W; the V placement of two chunks.

B is the input gradient (what the previous stage waits for), W the weight gradient (which nothing waits for).
A rank that would idle - waiting for an activation or a gradient - runs a pending W instead; W is also what frees
a micro-batch's activations (split_backward.py holds the graph until W).

- zb_h1 (schedules.py): 1F1B's order with each W delayed to fill the cooldown.
- zbv: two chunks per rank placed as a V: rank r holds virtual stages r and 2 pp - 1 - r, so the first rank holds
  the embedding and the loss, and the turn at the bottom of the V stays on the last rank without communication.
  At most 2 pp chunk-micro-batches in flight (each chunk half a stage: 1F1B's activation memory again). Its
  lists come from a greedy simulation with F = B = W = 1 time unit and free communication: every rank, whenever it
  is free, runs the first ready action in the order

    B (oldest micro-batch first; nearer the loss first)  >  F (under the in-flight limit)  >  W (oldest first)

  and otherwise waits a unit; `in flight` (F ran, W not yet) is held under the limit. Rank r cannot start
  before time r and each rank has 6m units of work, so (p-1) / (6m + p-1) is the least bubble any order reaches
  under these costs; the greedy lists reach it for every pp and m >= pp tried (timeline.py, tests).

The lists are a valid execution order (the simulation ran them), so they cannot deadlock with buffered sends; the
p2p plan and p2p.check_plan take care of NCCL's unbuffered ones.
"""

from __future__ import annotations

import functools

Action = tuple[str, int, int]


def stage_of(chunk: int, pp: int, rank: int, placement: str) -> int:
    """The virtual stage of `chunk` on `rank`: chunk * pp + rank ("loop", interleaved), or the V's two arms."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_of(stage: int, pp: int, placement: str) -> tuple[int, int]:
    """(rank, chunk) holding virtual `stage`."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


@functools.cache
def list_schedule(m: int, pp: int, chunks: int, placement: str, limit: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's action list from the greedy unit-time simulation described above."""
    stages = pp * chunks
    f_end: dict[tuple[int, int], int] = {}  # (micro, stage) -> time its F ended
    b_end: dict[tuple[int, int], int] = {}
    free = [0] * pp
    next_f = [[0] * chunks for _ in range(pp)]  # per rank and chunk: the next micro-batch to forward
    waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # (micro, chunk) with B done, W not
    in_flight = [0] * pp
    lists: list[list[Action]] = [[] for _ in range(pp)]
    total = 3 * m * stages
    done = 0
    while done < total:
        r = min(range(pp), key=lambda k: (free[k], k))
        t = free[r]
        choice = None
        ready_b = [(i, c) for c in range(chunks) for i in range(next_f[r][c])
                   if (i, stage_of(c, pp, r, placement)) not in b_end
                   and f_end[(i, stage_of(c, pp, r, placement))] <= t
                   and (stage_of(c, pp, r, placement) == stages - 1
                        or b_end.get((i, stage_of(c, pp, r, placement) + 1), t + 1) <= t)]
        if ready_b:
            i, c = min(ready_b, key=lambda ic: (ic[0], -stage_of(ic[1], pp, r, placement)))
            choice = ("B", i, c)
        elif in_flight[r] < limit:
            ready_f = [(next_f[r][c], c) for c in range(chunks) if next_f[r][c] < m and (
                stage_of(c, pp, r, placement) == 0
                or f_end.get((next_f[r][c], stage_of(c, pp, r, placement) - 1), t + 1) <= t)]
            if ready_f:  # the deeper stage first: it brings a micro-batch nearer its loss
                i, c = max(ready_f, key=lambda ic: (stage_of(ic[1], pp, r, placement), -ic[0]))
                choice = ("F", i, c)
        if choice is None and waiting_w[r]:
            i, c = waiting_w[r].pop(0)
            choice = ("W", i, c)
        if choice is None:  # nothing ready: wait one time unit (every action ends on a whole unit)
            if t > 2 * total:
                raise RuntimeError(f"zero-bubble planning stuck at t = {t} on rank {r} (m={m}, pp={pp})")
            free[r] = t + 1
            continue
        kind, i, c = choice
        s = stage_of(c, pp, r, placement)
        free[r] = t + 1
        if kind == "F":
            f_end[(i, s)] = t + 1
            next_f[r][c] += 1
            in_flight[r] += 1
        elif kind == "B":
            b_end[(i, s)] = t + 1
            waiting_w[r].append((i, c))
        else:
            in_flight[r] -= 1
        lists[r].append(choice)
        done += 1
    return tuple(tuple(actions) for actions in lists)


def zbv(m: int, pp: int, rank: int) -> list[Action]:
    return list(list_schedule(m, pp, 2, "v", 2 * pp)[rank])


def dualpipev(m: int, pp: int, rank: int) -> list[Action]:
    """DeepSeek's DualPipeV (the V-shaped half of DualPipe, DeepSeek-V3 report 2024) as a plain action list,
    on zbv's V placement. Its phases on rank r: 2 (pp - r - 1) chunk-0 forwards; r + 1 pairs (F0, F1); pp - r - 1
    rounds (B1 split, a W, F1); the steady state of m - 2 pp + r + 1 rounds (F0, B1, F1, B0): in DualPipe each
    (F, B) pair of two micro-batches runs overlapped, one's compute hiding the other's communication (here they
    run one after the other); pp - r - 1 rounds (B1, F1, B0); r + 1 rounds (B1, B0), split from the middle
    on; pp - r - 1 rounds (a W, B0 split); the last r + 1 W. Forwards and backwards of each chunk go in
    micro-batch order, the W passes in the order their B ran. Needs m >= 2 pp - 1 micro-batches."""
    if m < 2 * pp - 1:
        raise ValueError(f"the dualpipev schedule needs train.grad_accum (micro-batches) = {m} to be at least "
                         f"2 x parallel.pp - 1 = {2 * pp - 1}")
    actions: list[Action] = []
    forwards, backwards = [0, 0], [0, 0]
    deferred: list[tuple[int, int]] = []  # (micro, chunk) whose B ran split, waiting for their W

    def f(chunk: int) -> None:
        actions.append(("F", forwards[chunk], chunk))
        forwards[chunk] += 1

    def b(chunk: int, split: bool = False) -> None:
        actions.append(("B", backwards[chunk], chunk))
        if split:
            deferred.append((backwards[chunk], chunk))
        backwards[chunk] += 1

    def w() -> None:
        actions.append(("W", *deferred.pop(0)))

    for _ in range(2 * (pp - rank - 1)):
        f(0)
    for _ in range(rank + 1):
        f(0), f(1)
    for _ in range(pp - rank - 1):
        b(1, split=True), w(), f(1)
    for _ in range(m - 2 * pp + rank + 1):
        f(0), b(1), f(1), b(0)
    for _ in range(pp - rank - 1):
        b(1), f(1), b(0)
    split, middle = False, (rank + 1) // 2
    for i in range(rank + 1):  # from the middle on, backwards leave their W for the tail
        split = split or (i == middle and rank % 2 == 1)
        b(1, split)
        split = split or (i == middle and rank % 2 == 0)
        b(0, split)
    for _ in range(pp - rank - 1):
        w(), b(0, split=True)
    while deferred:
        w()
    return actions
