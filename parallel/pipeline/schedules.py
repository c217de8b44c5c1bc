"""Pipeline schedules as plain lists of actions, one list per pipeline rank.

An action is ("F" | "B", micro_batch, chunk): run the forward (or backward) of `micro_batch` through this
rank's model chunk `chunk` (virtual stage chunk * pp + rank). The engine turns the list into compute and p2p.

- GPipe: every forward, then every backward. Activations of all m micro-batches are held at once.
- 1F1B: pp - rank - 1 warm-up forwards, then one forward one backward, then the remaining backwards: at most
  pp micro-batches of activations alive on the first stage, whatever m is.
- Interleaved 1F1B (Narayanan et al. 2021): each rank holds v chunks; micro-batches go through the chunks in
  groups of pp, shrinking the bubble from (p-1)/(m+p-1) to (p-1)/(v m + p-1). Needs m to be a multiple of pp.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved")

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


def schedule(name: str, m: int, pp: int, rank: int, virtual: int = 1) -> list[Action]:
    if name == "gpipe":
        return gpipe(m, pp, rank)
    if name == "1f1b":
        return one_f_one_b(m, pp, rank)
    if name == "interleaved":
        return interleaved(m, pp, rank, virtual)
    raise ValueError(f"parallel.schedule = {name!r} is invalid; valid: {', '.join(SCHEDULES)}")


def forward_only(m: int, virtual: int = 1, pp: int | None = None) -> list[Action]:
    """Evaluation: every micro-batch through every chunk, no backward. With virtual chunks the micro-batches go
    in groups of pp, each group through every chunk before the next starts (the interleaved order): a stage then
    never holds more than a group's messages, which unbuffered p2p (NCCL) needs. pp None: one group."""
    group = pp or max(m, 1)
    return [("F", i, c) for start in range(0, m, group) for c in range(virtual)
            for i in range(start, min(start + group, m))]
