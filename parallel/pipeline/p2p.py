"""Point-to-point transfers between pipeline stages, planned per schedule and posted in paired batches.

| transfer       | runs after / before                  | from -> to                 | carries                |
|----------------|--------------------------------------|----------------------------|------------------------|
| send_forward   | after F(i, c) on a non-last stage    | stage s -> s + 1 (next)    | activation (b, s, d)   |
| recv_forward   | before F(i, c) on a non-first stage  | stage s - 1 (prev) -> s    | activation (b, s, d)   |
| send_backward  | after B(i, c) on a non-first stage   | stage s -> s - 1 (prev)    | d loss / d input       |
| recv_backward  | before B(i, c) on a non-last stage   | stage s + 1 (next) -> s    | d loss / d output      |

NCCL ignores tags and may hold a send until the peer posts the matching receive, so two ranks that each send
before they receive wait for each other forever. The plan (see `plan`) therefore posts sends and receives in
batches, one `batch_isend_irecv` between two slots of compute, that pair what a rank sends with what it needs
next. Messages between two ranks are matched in posting order, never by tag; `check_plan` simulates every rank
under exactly those rules (a rank posts its next batch only when its last one completed, and an op completes
only when the peer's posted batch holds the matching op, in per-peer order, with the same identity), and the
tests run it for every schedule; the engine executes the very plan that was checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazoo.parallel.pipeline.schedules import Action


@dataclass(frozen=True)
class Transfer:
    """One message, named by what it carries: `backward` False for an activation, True for its gradient;
    `src_stage` the virtual stage that produced it (the receiver is src_stage + 1 forward, - 1 backward)."""

    send: bool  # True: this rank sends it; False: this rank receives it
    peer: int  # pipeline rank (index in the pipeline, not the global rank)
    micro: int
    src_stage: int
    backward: bool

    @property
    def identity(self) -> tuple[int, int, bool]:
        return (self.micro, self.src_stage, self.backward)


@dataclass(frozen=True)
class Step:
    transfers: tuple[Transfer, ...]  # posted together and waited for before `action` (may be empty)
    action: Action | None  # None: the final flush of outstanding sends


def _transfers(action: Action, pp: int, pp_rank: int, stages: int) -> tuple[Transfer | None, Transfer | None]:
    """(what this action must receive before it runs, what it sends after it ran); None where nothing."""
    kind, micro, chunk = action
    stage = chunk * pp + pp_rank
    prev, nxt = (pp_rank - 1) % pp, (pp_rank + 1) % pp
    if kind == "F":
        return (Transfer(False, prev, micro, stage - 1, False) if stage > 0 else None,
                Transfer(True, nxt, micro, stage, False) if stage < stages - 1 else None)
    return (Transfer(False, nxt, micro, stage + 1, True) if stage < stages - 1 else None,
            Transfer(True, prev, micro, stage, True) if stage > 0 else None)


def plan(actions: list[Action], pp: int, pp_rank: int, virtual: int = 1, warmup: int | None = None) -> list[Step]:
    """The transfers of this rank's `actions`, grouped into the batches it posts.

    Actions run in slots: each (forward, backward) pair of a 1F1B steady state (after the `warmup` forwards:
    schedules.warmup_forwards) is one slot, every other action a slot of its own. Between two slots ONE batch
    goes out: every send the last slot produced and every receive the next slot needs (for a pair, the
    backward's gradient too). This is Megatron-LM's grouping (send_forward_recv_forward in the warm-up,
    send_forward_backward_recv_forward_backward in the steady state); `check_plan` shows it deadlock-free
    for a given schedule. A slot-by-slot grouping without the pairs (each send with the very next receive)
    deadlocks interleaved schedules under NCCL's rules: the tests keep that counter-example."""
    stages = pp * virtual
    steady = range(0) if warmup is None else range(warmup, warmup + 2 * (sum(a[0] == "F" for a in actions) - warmup))
    slots: list[list[Action]] = []
    for k, action in enumerate(actions):
        if k in steady and (k - warmup) % 2 == 1:  # the backward of a steady (forward, backward) pair
            slots[-1].append(action)
        else:
            slots.append([action])
    steps: list[Step] = []
    sends: list[Transfer] = []
    for slot in slots:
        recvs = [t for t in (_transfers(a, pp, pp_rank, stages)[0] for a in slot) if t is not None]
        steps.append(Step(tuple(sends + recvs), slot[0]))
        steps += [Step((), action) for action in slot[1:]]
        sends = [t for t in (_transfers(a, pp, pp_rank, stages)[1] for a in slot) if t is not None]
    if sends:
        steps.append(Step(tuple(sends), None))
    return steps


def check_plan(plans: list[list[Step]]) -> None:
    """Run every rank's plan under rendezvous semantics: a rank posts its next batch only when its previous batch
    completed, and an op completes only when the peer's currently posted batch holds the matching op (the k-th
    send from a to b meets the k-th receive on b from a). Raises ValueError on a deadlock or when matched
    messages differ (a receive would get the wrong tensor)."""
    pp = len(plans)
    batches = [[step.transfers for step in steps if step.transfers] for steps in plans]
    order: dict[tuple[int, int, Transfer], int] = {}  # (rank, batch index, op) -> position in its channel
    counts: dict[tuple[int, int, bool], int] = {}
    channel: dict[tuple[int, int, int], Transfer] = {}  # (src, dst, k) -> the k-th message sent src -> dst
    for rank in range(pp):
        for b, batch in enumerate(batches[rank]):
            for op in batch:
                key = (rank, op.peer, op.send)
                order[(rank, b, op)] = counts.get(key, 0)
                counts[key] = counts.get(key, 0) + 1
                if op.send:
                    channel[(rank, op.peer, order[(rank, b, op)])] = op
    for rank in range(pp):  # per-peer order: the k-th receive must expect the k-th message sent
        for b, batch in enumerate(batches[rank]):
            for op in (o for o in batch if not o.send):
                sent = channel.get((op.peer, rank, order[(rank, b, op)]))
                if sent is None or sent.identity != op.identity:
                    raise ValueError(f"pipeline rank {rank} receives {op.identity} from rank {op.peer} but the "
                                     f"message sent there in that position is {sent and sent.identity}")
    position = [0] * pp
    completed: set[tuple[int, int, Transfer]] = set()
    while any(position[r] < len(batches[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):  # match every posted op whose peer has posted its counterpart
            if position[rank] >= len(batches[rank]):
                continue
            b = position[rank]
            for op in batches[rank][b]:
                peer = op.peer
                if (rank, b, op) in completed or position[peer] >= len(batches[peer]):
                    continue
                pb = position[peer]
                for other in batches[peer][pb]:
                    if (other.peer == rank and other.send != op.send and (peer, pb, other) not in completed
                            and order[(peer, pb, other)] == order[(rank, b, op)]):
                        completed.update({(rank, b, op), (peer, pb, other)})
                        progressed = True
                        break
        for rank in range(pp):  # a batch is done when all of its ops met their peers
            b = position[rank]
            if b < len(batches[rank]) and all((rank, b, op) in completed for op in batches[rank][b]):
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: batches[r][position[r]] for r in range(pp) if position[r] < len(batches[r])}
            raise ValueError(f"pipeline p2p deadlock: every rank waits (rank -> posted batch): {stuck}")


def post(transfers: tuple[Transfer, ...], tensors: list[torch.Tensor], pp_ranks: tuple[int, ...]) -> None:
    """Post one batch (sends and receives together) and wait for all of it. `tensors[i]` is what transfer i
    sends, or the buffer it receives into. Collective: batch_isend_irecv over the pipeline's ranks."""
    if not transfers:
        return
    ops = [dist.P2POp(dist.isend if t.send else dist.irecv, tensor, pp_ranks[t.peer])
           for t, tensor in zip(transfers, tensors)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
