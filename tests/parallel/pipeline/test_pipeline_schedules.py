"""Schedules and partitions as pure functions: every schedule is complete, respects dependencies, cannot
deadlock with non-blocking sends, and holds the activations its theory says."""

from __future__ import annotations

import pytest

from megazoo.parallel.pipeline.partition import rank_chunks, virtual_stage_layers
from megazoo.parallel.pipeline.schedules import forward_only, schedule


def simulate(name: str, m: int, pp: int, v: int = 1):
    """Run every rank's action list with blocking receives and non-blocking sends; return per-rank peak live
    micro-batches. Fails on a deadlock, a missing or repeated action, or a dependency violation."""
    programs = {r: schedule(name, m, pp, r, v) for r in range(pp)}
    stages = pp * v
    done_f, done_b = set(), set()  # (micro, virtual stage)
    pc = {r: 0 for r in range(pp)}
    live = {r: 0 for r in range(pp)}
    peak = {r: 0 for r in range(pp)}
    while any(pc[r] < len(programs[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pc[r] == len(programs[r]):
                continue
            kind, micro, chunk = programs[r][pc[r]]
            s = chunk * pp + r
            if kind == "F":
                ready = s == 0 or (micro, s - 1) in done_f
                if ready:
                    assert (micro, s) not in done_f
                    done_f.add((micro, s))
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
            else:
                ready = (micro, s) in done_f and (s == stages - 1 or (micro, s + 1) in done_b)
                if ready:
                    assert (micro, s) not in done_b
                    done_b.add((micro, s))
                    live[r] -= 1
            if ready:
                pc[r] += 1
                progressed = True
        assert progressed, f"{name} deadlocks at {pc}"
    every = {(i, s) for i in range(m) for s in range(stages)}
    assert done_f == every and done_b == every
    return peak


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gpipe_and_1f1b_complete_and_deadlock_free(pp, m):
    gpipe = simulate("gpipe", m, pp)
    one_f_one_b = simulate("1f1b", m, pp)
    assert gpipe[0] == m  # GPipe holds every micro-batch on the first stage
    for r in range(pp):
        assert one_f_one_b[r] <= min(pp - r, m)  # 1F1B: at most pp - rank micro-batches in flight
    assert one_f_one_b[0] == min(pp, m)


@pytest.mark.parametrize("pp, v, m", [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 8), (2, 3, 4), (4, 3, 8)])
def test_interleaved_complete_and_deadlock_free(pp, v, m):
    simulate("interleaved", m, pp, v)
    actions = schedule("interleaved", m, pp, 0, v)
    assert sorted(a for a in actions if a[0] == "F") == sorted(("F", i, c) for i in range(m) for c in range(v))


def test_interleaved_needs_a_multiple_of_pp():
    with pytest.raises(ValueError, match="multiple of parallel.pp = 4"):
        schedule("interleaved", 6, 4, 0, 2)
    with pytest.raises(ValueError, match="parallel.schedule = 'zigzag' is invalid"):
        schedule("zigzag", 4, 2, 0)


def test_forward_only_visits_every_chunk():
    assert forward_only(2, 2) == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]


def test_uniform_partition_and_chunks():
    assert virtual_stage_layers(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    stages = virtual_stage_layers(8, 2, virtual=2)
    assert stages == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_chunks(stages, 2, 0) == [0, 2] and rank_chunks(stages, 2, 1) == [1, 3]


def test_parameter_balanced_partition_gives_the_embedding_stage_fewer_blocks():
    stages = virtual_stage_layers(12, 3, method="parameters", first_extra=3.0)
    assert [len(s) for s in stages] == [2, 5, 5]
    assert [i for s in stages for i in s] == list(range(12))


def test_explicit_layers_must_cover_every_block_once():
    assert virtual_stage_layers(4, 2, layers=[[0], [1, 2, 3]]) == [[0], [1, 2, 3]]
    for bad in ([[0, 1], [1, 2, 3]], [[0, 1], [3]], [[0, 1, 2, 3], []], [[1, 0], [2, 3]]):
        with pytest.raises(ValueError, match="every block 0..3 exactly once"):
            virtual_stage_layers(4, 2, layers=bad)
    with pytest.raises(ValueError, match="has 3 stages but pp x virtual_stages = 2"):
        virtual_stage_layers(4, 2, layers=[[0], [1], [2, 3]])


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(ValueError, match="= 6 stages is more than the model's 4 blocks"):
        virtual_stage_layers(4, 3, virtual=2)
