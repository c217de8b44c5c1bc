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

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazoo.parallel.pipeline.schedules import (SPLIT_BACKWARD, Action, forward_only, placement, schedule,
                                                 warmup_forwards)
from megazoo.parallel.pipeline.zero_bubble import rank_of, stage_of


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


def _transfers(action: Action, pp: int, pp_rank: int, stages: int,
               placement: str = "loop") -> tuple[Transfer | None, Transfer | None]:
    """(what this action must receive before it runs, what it sends after it ran); None where nothing: the
    first / last stage, a W (no communication), and a hop between two stages on this very rank (the bottom of
    zbv's V: the engine hands that tensor over in memory, see `is_local`)."""
    kind, micro, chunk = action
    if kind == "W":
        return None, None
    stage = stage_of(chunk, pp, pp_rank, placement)

    def remote(send: bool, other: int, src: int, backward: bool) -> Transfer | None:
        peer = rank_of(other, pp, placement)[0]
        return None if peer == pp_rank else Transfer(send, peer, micro, src, backward)

    if kind == "F":
        return (remote(False, stage - 1, stage - 1, False) if stage > 0 else None,
                remote(True, stage + 1, stage, False) if stage < stages - 1 else None)
    return (remote(False, stage + 1, stage + 1, True) if stage < stages - 1 else None,
            remote(True, stage - 1, stage, True) if stage > 0 else None)


def is_local(src_stage: int, dst_stage: int, pp: int, placement: str) -> bool:
    """Both stages on one rank: the tensor is handed over in memory, never posted."""
    return rank_of(src_stage, pp, placement)[0] == rank_of(dst_stage, pp, placement)[0]


def plan(actions: list[Action], pp: int, pp_rank: int, virtual: int = 1, warmup: int | None = None,
         placement: str = "loop") -> list[Step]:
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
        recvs = [t for t in (_transfers(a, pp, pp_rank, stages, placement)[0] for a in slot) if t is not None]
        steps.append(Step(tuple(sends + recvs), slot[0]))
        steps += [Step((), action) for action in slot[1:]]
        sends = [t for t in (_transfers(a, pp, pp_rank, stages, placement)[1] for a in slot) if t is not None]
    if sends:
        steps.append(Step(tuple(sends), None))
    return steps


def plan_jointly(lists: list[list[Action]], virtual: int = 1, placement: str = "loop") -> list[list[Step]]:
    """Every rank's plan at once, for schedules whose ranks need messages in another order than their peers
    send them (zbv's V: rank 0 sends rank 1 both stage 0's activations and stage 2 pp - 1's gradients, and
    rank 1 may need a later-sent one first; NCCL matches by position, so per-action pairing deadlocks).

    Lockstep rounds over the ranks' action lists (a valid execution order): in the exchange half of a round,
    every rank posts one batch holding the message its next action needs - with every earlier message of the
    same channel, in channel order (they wait in the engine's inbox) - and the messages it holds that a peer's
    batch in this round receives; in the compute half, every rank whose next action has its inputs runs it
    (its outputs wait in the engine's outbox until a peer asks). Each op in a round meets its counterpart in the
    same round, so every batch completes: deadlock-free by construction, and `check_plan` confirms it."""
    pp = len(lists)
    stages = pp * virtual
    steps: list[list[Step]] = [[] for _ in range(pp)]
    pc = [0] * pp
    inbox: list[set[tuple[int, int, bool]]] = [set() for _ in range(pp)]
    outbox: list[list[Transfer]] = [[] for _ in range(pp)]  # produced, not yet sent, in production order
    while any(pc[r] < len(lists[r]) for r in range(pp)):
        wanted: list[list[Transfer]] = [[] for _ in range(pp)]  # the receives each rank posts this round
        sending: list[list[Transfer]] = [[] for _ in range(pp)]
        for r in range(pp):
            need = _transfers(lists[r][pc[r]], pp, r, stages, placement)[0] if pc[r] < len(lists[r]) else None
            if need is None or need.identity in inbox[r]:
                continue
            held = [t for t in outbox[need.peer] if t.peer == r]  # the channel need.peer -> r, in order
            ids = [t.identity for t in held]
            if need.identity in ids:
                sending[need.peer] += held[:ids.index(need.identity) + 1]
                wanted[r] = [Transfer(False, need.peer, *t.identity) for t in held[:ids.index(need.identity) + 1]]
        for r in range(pp):
            if sending[r] or wanted[r]:
                steps[r].append(Step(tuple(sending[r] + wanted[r]), None))
                outbox[r] = [o for o in outbox[r] if o not in sending[r]]
                inbox[r].update(t.identity for t in wanted[r])
        computed = False
        for r in range(pp):
            if pc[r] == len(lists[r]):
                continue
            action = lists[r][pc[r]]
            need, out = _transfers(action, pp, r, stages, placement)
            if need is not None and need.identity not in inbox[r]:
                continue
            if need is not None:
                inbox[r].discard(need.identity)
            steps[r].append(Step((), action))
            if out is not None:
                outbox[r].append(out)
            pc[r] += 1
            computed = True
        if not computed and not any(wanted):
            raise ValueError("the schedule cannot run: ranks wait at "
                             f"{[lists[r][pc[r]] if pc[r] < len(lists[r]) else None for r in range(pp)]}")
    assert not any(outbox), "a message was produced that no rank receives"
    return steps


@functools.cache
def _joint(name: str, m: int, pp: int, virtual: int, evaluation: bool) -> tuple[tuple[Step, ...], ...]:
    lists = [forward_only(m, virtual, pp) if evaluation else schedule(name, m, pp, r, virtual) for r in range(pp)]
    return tuple(tuple(steps) for steps in plan_jointly(lists, virtual, placement(name)))


def plan_for(name: str, m: int, pp: int, pp_rank: int, virtual: int = 1) -> list[Step]:
    """This rank's plan of schedule `name` over m micro-batches: what the trainer runs and the tests check."""
    if name in SPLIT_BACKWARD:
        return list(_joint(name, m, pp, virtual, False)[pp_rank])
    return plan(schedule(name, m, pp, pp_rank, virtual), pp, pp_rank, virtual,
                warmup=warmup_forwards(name, m, pp, pp_rank, virtual))


def evaluation_plan_for(name: str, m: int, pp: int, pp_rank: int, virtual: int = 1) -> list[Step]:
    """Forward only (evaluation), every micro-batch through every chunk, on the schedule's placement."""
    if placement(name) != "loop":
        return list(_joint(name, m, pp, virtual, True)[pp_rank])
    return plan(forward_only(m, virtual, pp), pp, pp_rank, virtual)


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
