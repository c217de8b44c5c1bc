"""Pipeline point-to-point transfers under NCCL's rules, on CPU.

NCCL matches messages between two ranks in posting order (tags ignored) and may hold a send until the peer has
posted the matching receive. `check_plan` runs every rank's batches under exactly that rendezvous rule; here it
runs for every schedule (the zero-bubble ones included) at pp 2, 3, 4 and 8 and every micro-batch count listed,
with the trainer's own plans (plan_for), and is shown to catch the classic deadlocks. The multi-process tests run the real engine over gloo with each batch a `batch_isend_irecv`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

from megazoo.parallel.pipeline.p2p import (Step, Transfer, check_plan, evaluation_plan_for, plan, plan_for,
                                           plan_jointly, post)
from megazoo.parallel.pipeline.schedules import forward_only, schedule
from megazoo.parallel.topology import Topology

CASES = [(name, pp, m, v) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb_h1", 1),
                         ("zbv", 2), ("dualpipev", 2))
         if (name != "interleaved" or m % pp == 0) and (name != "dualpipev" or m >= 2 * pp - 1)]


def plans(name: str, m: int, pp: int, v: int) -> list[list[Step]]:
    return [plan_for(name, m, pp, r, v) for r in range(pp)]


@pytest.mark.parametrize("name, pp, m, v", CASES, ids=lambda x: str(x))
def test_every_schedule_is_deadlock_free_under_rendezvous_sends(name, pp, m, v):
    check_plan(plans(name, m, pp, v))


@pytest.mark.parametrize("pp, m, v", [(pp, m, v) for pp in (2, 3, 4, 8) for m in (1, 3, 4, 8, 16) for v in (1, 2, 3)])
def test_forward_only_evaluation_is_deadlock_free(pp, m, v):
    check_plan([plan(forward_only(m, v, pp), pp, r, v) for r in range(pp)])


@pytest.mark.parametrize("name, pp, m, v", CASES, ids=lambda x: str(x))
def test_each_message_is_received_in_the_order_it_was_sent(name, pp, m, v):
    """Per pair of ranks and direction, the k-th receive expects exactly the k-th message sent (what NCCL's
    tag-less matching will deliver), and every message sent is received once."""
    all_plans = plans(name, m, pp, v)
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, steps in enumerate(all_plans):
        for t in (t for step in steps for t in step.transfers):
            key = (rank, t.peer) if t.send else (t.peer, rank)
            (sent if t.send else received).setdefault(key, []).append(t.identity)
    assert sent == received
    # Every action that needs a message has one: activations into every non-first stage, gradients back; zbv's
    # turn (stage pp - 1 to pp, both on the last rank) is handed over in memory.
    hops = pp * v - 1 - (1 if name in ("zbv", "dualpipev") else 0)
    assert sum(len(x) for x in sent.values()) == 2 * m * hops
    actions = [a for steps in all_plans for a in (s.action for s in steps) if a is not None]
    count = {kind: sum(a[0] == kind for a in actions) for kind in "FBW"}
    assert count["F"] == count["B"] == m * pp * v  # F, B (and W: every B of zb_h1 / zbv, some of dualpipev's)
    assert count["W"] == (m * pp * v if name in ("zb_h1", "zbv") else 0 if name != "dualpipev" else count["W"])


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("pp, m", [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 3, 4, 8, 16)])
def test_v_placed_evaluation_is_deadlock_free(name, pp, m):
    check_plan([evaluation_plan_for(name, m, pp, r, 2) for r in range(pp)])


def test_per_action_pairing_deadlocks_zbv_and_the_joint_plan_does_not():
    """The counter-example behind plan_jointly: with each send batched with the very next receive, zbv's V
    (rank 0 sends rank 1 both activations and gradients, needed in another order) fails under NCCL's rules."""
    lists = [schedule("zbv", 8, 4, r, 2) for r in range(4)]
    with pytest.raises(ValueError, match="deadlock|receives"):
        check_plan([plan(lists[r], 4, r, 2, warmup=None, placement="v") for r in range(4)])
    check_plan(plan_jointly(lists, 2, "v"))


def test_the_check_catches_a_send_before_receive_cycle():
    """Each send posted alone before its receive (plain isend/irecv in schedule order) deadlocks 1F1B under
    rendezvous semantics: the check must say so, naming the waiting ranks."""
    def naive(rank: int) -> list[Step]:
        steps = []
        for kind, micro, chunk in schedule("1f1b", 4, 2, rank):
            stage = rank
            if kind == "F":
                if stage == 1:
                    steps.append(Step((Transfer(False, 0, micro, 0, False),), None))
                steps.append(Step((), (kind, micro, chunk)))
                if stage == 0:
                    steps.append(Step((Transfer(True, 1, micro, 0, False),), None))
            else:
                if stage == 0:
                    steps.append(Step((Transfer(False, 1, micro, 1, True),), None))
                steps.append(Step((), (kind, micro, chunk)))
                if stage == 1:
                    steps.append(Step((Transfer(True, 0, micro, 1, True),), None))
        return steps

    with pytest.raises(ValueError, match="deadlock"):
        check_plan([naive(0), naive(1)])


def test_the_check_catches_messages_in_the_wrong_order():
    first = [Step((Transfer(True, 1, 0, 0, False), Transfer(True, 1, 1, 0, False)), None)]
    second = [Step((Transfer(False, 0, 1, 0, False), Transfer(False, 0, 0, 0, False)), None)]
    with pytest.raises(ValueError, match="receives"):
        check_plan([first, second])


def test_pairing_without_the_steady_state_grouping_deadlocks_interleaved():
    """The counter-example behind the grouping: each send batched with the very next receive only (no
    (forward, backward) pairs in the steady state) deadlocks the interleaved schedule."""
    with pytest.raises(ValueError, match="deadlock"):
        check_plan([plan(schedule("interleaved", 8, 4, r, 2), 4, r, 2, warmup=None) for r in range(4)])
    check_plan(plans("interleaved", 8, 4, 2))  # the same schedule with the grouping


def _exchange(large: int):
    """Two ranks post a batch each holding a send to and a receive from the other: a send-before-receive cycle
    that must complete because both directions are in one batch_isend_irecv."""
    topo = Topology.build(dp=1, pp=2)
    rank, peer = topo.pp_rank, 1 - topo.pp_rank
    out = torch.full((large,), float(rank))
    into = torch.empty(large)
    post((Transfer(True, peer, 0, rank, False), Transfer(False, peer, 0, peer, False)), [out, into], topo.pp_ranks)
    dist.barrier()
    return float(into[0]), float(into[-1])


def test_paired_batch_exchanges_large_buffers_both_ways():
    results = run_distributed(_exchange, 2, 1 << 22)  # 16 MiB each way
    assert results == [(1.0, 1.0), (0.0, 0.0)]


def test_pipeline_times_come_from_cuda_events_on_a_gpu(monkeypatch):
    """Host clocks around a CUDA kernel time its launch: on a GPU the stats record events and read them after
    the step (CUDA's Event is faked here: each event is stamped with a counter in milliseconds)."""
    from megazoo.parallel.pipeline.engine import PipelineStats

    clock = iter(range(0, 1000, 10))

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.ms, self.synced = None, False

        def record(self):
            self.ms = next(clock)

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, end):
            assert end.synced, "read only after the end event completed"
            return end.ms - self.ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    stats = PipelineStats(device=torch.device("cuda"))
    whole = stats.start()          # t = 0 ms
    compute = stats.start()        # t = 10
    stats.stop(compute, busy=True)  # t = 20: 10 ms busy
    stats.stop(whole, busy=False)   # t = 30: 30 ms in all
    assert stats.busy_s == pytest.approx(0.010) and stats.total_s == pytest.approx(0.030)
    assert stats.bubble == pytest.approx(2 / 3)
    stats.reset()
    assert stats.busy_s == 0.0 and stats.max_live_micro_batches == 0
