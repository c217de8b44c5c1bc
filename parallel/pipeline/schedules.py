"""Pipeline schedules as plain lists of actions, one list per pipeline rank.

An action is ("F" | "B" | "W", micro_batch, chunk): run the forward (or backward) of `micro_batch` through this
rank's model chunk `chunk` (virtual stage chunk * pp + rank; the V placement of zbv: zero_bubble.stage_of). A
backward whose (micro_batch, chunk) also has a W action is split: B is then the input gradient only and W, later,
the weight gradient (split_backward.py); zb_h1 and zbv split every backward, dualpipev some. The engine turns the
list into compute and p2p.

- GPipe: every forward, then every backward. Activations of all m micro-batches are held at once.
- 1F1B: pp - rank - 1 warm-up forwards, then one forward one backward, then the remaining backwards: at most
  pp micro-batches of activations alive on the first stage, whatever m is.
- Interleaved 1F1B (Narayanan et al. 2021): each rank holds v chunks; micro-batches go through the chunks in
  groups of pp, shrinking the bubble from (p-1)/(m+p-1) to (p-1)/(v m + p-1). Needs m to be a multiple of pp.
- ZB-H1 (Qi et al. 2024): 1F1B's order of F and B; on rank r the W of micro-batch j runs right after the B of
  micro-batch j + r (rank 0: right after its own B) and the last r W passes at the end, where they fill the
  cooldown. At most pp micro-batches in flight (F ran, W not yet) on any rank: 1F1B's peak (its first stage
  holds pp), so the same activation memory; the bubble falls from 1F1B's (p-1)(F+B+W) to (p-1)(F+B-W), a third
  of it when F = B = W: (p-1)/(3m+p-1) for m >= p (timeline.py reproduces it exactly).
- ZBV and DualPipeV: two chunks per rank in a V, in zero_bubble.py.
"""

from __future__ import annotations

from megazoo.parallel.pipeline.zero_bubble import dualpipev, stage_of, zbv

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "zbv", "dualpipev")
# Model chunks per rank (parallel.virtual_stages) each schedule needs; None: any >= 2.
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": None, "zb_h1": 1, "zbv": 2, "dualpipev": 2}
# The zero-bubble schedules: their backward runs as B then W (split_backward.py), so their W passes shift sends
# against receives (p2p.py plans them jointly) and B..W holds the weight-gradient store (the planner).
SPLIT_BACKWARD = ("zb_h1", "zbv", "dualpipev")

__all__ = ["SCHEDULES", "CHUNKS", "SPLIT_BACKWARD", "Action", "schedule", "placement", "stage_of", "warmup_forwards", "forward_only"]

Action = tuple[str, int, int]


def gpipe(m: int, pp: int, rank: int) -> list[Action]:
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def warmup_forwards(name: str, m: int, pp: int, rank: int, virtual: int = 1) -> int | None:
    """How many forwards a 1F1B-style schedule runs before its steady state of (forward, backward) pairs; None
    for schedules without one (GPipe). The p2p plan (p2p.py) batches each steady pair's transfers together."""
    if name == "1f1b":
        return min(pp - rank - 1, m)
    if name == "interleaved":
        return min((pp - rank - 1) * 2 + (virtual - 1) * pp, m * virtual)
    return None


def one_f_one_b(m: int, pp: int, rank: int) -> list[Action]:
    warmup = warmup_forwards("1f1b", m, pp, rank)
    actions: list[Action] = [("F", i, 0) for i in range(warmup)]
    next_b = 0
    for i in range(warmup, m):
        actions.append(("F", i, 0))
        actions.append(("B", next_b, 0))
        next_b += 1
    actions += [("B", i, 0) for i in range(next_b, m)]
    return actions


def interleaved(m: int, pp: int, rank: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved schedule: the k-th forward of this rank is micro-batch
    (k // (pp v)) pp + k % pp through chunk (k // pp) % v; backwards visit chunks in reverse."""
    if m % pp:
        raise ValueError(f"the interleaved schedule needs train.grad_accum (micro-batches) = {m} to be a multiple "
                         f"of parallel.pp = {pp}")
    total = m * v

    def forward(k: int) -> Action:
        return ("F", (k // (pp * v)) * pp + k % pp, (k // pp) % v)

    def backward(k: int) -> Action:
        return ("B", (k // (pp * v)) * pp + k % pp, v - 1 - (k // pp) % v)

    warmup = warmup_forwards("interleaved", m, pp, rank, v)
    actions = [forward(k) for k in range(warmup)]
    for k in range(warmup, total):
        actions.append(forward(k))
        actions.append(backward(k - warmup))
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


def zb_h1(m: int, pp: int, rank: int) -> list[Action]:
    actions: list[Action] = []
    backwards = weights = 0
    for action in one_f_one_b(m, pp, rank):
        actions.append(action)
        if action[0] == "B":
            backwards += 1
            if backwards > rank:  # the W of micro-batch j after the B of j + rank
                actions.append(("W", weights, 0))
                weights += 1
    return actions + [("W", j, 0) for j in range(weights, m)]


def placement(name: str) -> str:
    """How a schedule places virtual stages on ranks: "v" (zbv, dualpipev) or "loop" (stage = chunk * pp + rank)."""
    return "v" if name in ("zbv", "dualpipev") else "loop"


def schedule(name: str, m: int, pp: int, rank: int, virtual: int = 1) -> list[Action]:
    if name == "gpipe":
        return gpipe(m, pp, rank)
    if name == "1f1b":
        return one_f_one_b(m, pp, rank)
    if name == "interleaved":
        return interleaved(m, pp, rank, virtual)
    if name == "zb_h1":
        return zb_h1(m, pp, rank)
    if name == "zbv":
        return zbv(m, pp, rank)
    if name == "dualpipev":
        return dualpipev(m, pp, rank)
    raise ValueError(f"parallel.schedule = {name!r} is invalid; valid: {', '.join(SCHEDULES)}")


def forward_only(m: int, virtual: int = 1, pp: int | None = None) -> list[Action]:
    """Evaluation: every micro-batch through every chunk, no backward. With virtual chunks the micro-batches go
    in groups of pp, each group through every chunk before the next starts (the interleaved order): a stage then
    never holds more than a group's messages, which unbuffered p2p (NCCL) needs. pp None: one group."""
    group = pp or max(m, 1)
    return [("F", i, c) for start in range(0, m, group) for c in range(virtual)
            for i in range(start, min(start + group, m))]
