"""Zero-bubble schedules as pure functions: complete, dependency-respecting action lists whose ideal timeline
(F = B = W = 1, free communication: parallel/pipeline/timeline.py) has the bubble their theory says, at the
activation memory their theory says."""

from __future__ import annotations

import pytest

from megazoo.parallel.pipeline.partition import rank_chunks, virtual_stage_layers
from megazoo.parallel.pipeline.schedules import SCHEDULES, placement, schedule
from megazoo.parallel.pipeline.timeline import simulate
from megazoo.parallel.pipeline.zero_bubble import rank_of, stage_of

PPS, MS = (2, 3, 4, 8), (1, 2, 3, 4, 5, 8, 16)
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb_h1": 1, "zbv": 2, "dualpipev": 2}


def timeline(name: str, m: int, pp: int):
    v = CHUNKS[name]
    return simulate([schedule(name, m, pp, r, v) for r in range(pp)], pp * v, placement(name))


@pytest.mark.parametrize("name, pp, m", [(name, pp, m) for name in SCHEDULES for pp in PPS for m in MS
                                         if (name != "interleaved" or m % pp == 0)  # interleaved: m = k pp
                                         and (name != "dualpipev" or m >= 2 * pp - 1)])
def test_every_schedule_runs_every_action_once_in_dependency_order(name, pp, m):
    timeline(name, m, pp)  # raises on a deadlock, a repeated or missing F/B/W, or an unmet dependency


@pytest.mark.parametrize("name", ["zb_h1", "zbv", "dualpipev"])
def test_each_w_follows_its_own_b_on_the_same_rank(name):
    v = CHUNKS[name]
    for r in range(4):
        actions = schedule(name, 8, 4, r, v)
        for kind, i, c in actions:
            if kind == "W":
                assert actions.index(("B", i, c)) < actions.index(("W", i, c))
        weights = sorted(a[1:] for a in actions if a[0] == "W")
        if name == "dualpipev":  # only the backwards of its zero-bubble phases are split: 2 (pp - r - 1) + r + 1
            assert len(weights) == len(set(weights)) == 2 * (4 - r - 1) + r + 1
        else:
            assert weights == sorted((i, c) for i in range(8) for c in range(v))


@pytest.mark.parametrize("pp", PPS)
def test_dualpipev_without_overlap_matches_zbv_at_dualpipe_memory(pp):
    """Run one after the other (no overlap of its paired F and B), DualPipeV's lists reach ZBV's least bubble;
    they hold one more chunk of activations than ZBV's: 2 pp + 1 (DualPipe's figure)."""
    for m in (2 * pp - 1, 2 * pp, 3 * pp):
        dual, zbv = timeline("dualpipev", m, pp), timeline("zbv", m, pp)
        assert dual.bubble == pytest.approx(zbv.bubble) == pytest.approx((pp - 1) / (6 * m + pp - 1))
        assert max(dual.peak_in_flight) == 2 * pp + 1
    with pytest.raises(ValueError, match="at least 2 x parallel.pp - 1 = 7"):
        schedule("dualpipev", 6, 4, 0, 2)


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("m", [m for m in MS if m > 1])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_1f1b_memory(pp, m):
    one_f_one_b, zb = timeline("1f1b", m, pp), timeline("zb_h1", m, pp)
    assert one_f_one_b.bubble == pytest.approx((pp - 1) / (m + pp - 1))  # the simulator knows 1F1B's theory
    if m >= pp:  # (p-1)(F+B-W) of bubble against 1F1B's (p-1)(F+B+W)
        assert zb.bubble == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert zb.bubble < one_f_one_b.bubble
    assert max(zb.peak_in_flight) == max(one_f_one_b.peak_in_flight) == min(pp, m)  # 1F1B's peak activations


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("m", [m for m in MS if m > 1])
def test_zbv_reaches_the_least_bubble_with_two_half_chunks(pp, m):
    zbv, zb = timeline("zbv", m, pp), timeline("zb_h1", m, pp)
    if m >= pp:  # rank r starts at r and has 6m units of work: nothing shorter exists
        assert zbv.bubble == pytest.approx((pp - 1) / (6 * m + pp - 1))
    assert zbv.bubble < zb.bubble
    # In flight: at most 2 pp half-stage chunks of activations, 1F1B's pp stages' worth.
    assert max(zbv.peak_in_flight) <= 2 * min(pp, m)


def test_v_placement():
    pp = 4
    assert [stage_of(c, pp, r, "v") for r in range(pp) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(rank_of(stage_of(c, pp, r, "v"), pp, "v") == (r, c) for r in range(pp) for c in (0, 1))
    stages = virtual_stage_layers(8, pp, virtual=2)
    assert rank_chunks(stages, pp, 0, "v") == [0, 7] and rank_chunks(stages, pp, 3, "v") == [3, 4]
    assert placement("zbv") == "v" and placement("zb_h1") == placement("interleaved") == "loop"


def test_the_timeline_catches_an_impossible_order():
    lists = [[("F", 0, 0), ("B", 0, 0)], [("B", 0, 0), ("F", 0, 0)]]  # rank 1 backward before its forward
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(lists, 2)
    with pytest.raises(ValueError, match="missing"):
        simulate([[("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]], 2)
    with pytest.raises(ValueError, match="twice"):
        simulate([[("F", 0, 0), ("B", 0, 0)], [("F", 0, 0), ("B", 0, 0), ("W", 0, 0), ("W", 0, 0)]], 2)
