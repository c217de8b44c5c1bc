"""Each pipeline schedule's activation peak: the planner's against the real run's (issue 29).

The planner (recipes/planner/activations.py) walks every rank's own action list (recipes/planner/schedule_memory.py):
what a micro-batch holds from F to B, from a split B to its W (split_backward.py's store: each linear's input and
output gradient, the head's weight gradient) and a backward's workspace. Here every schedule - GPipe, 1F1B,
interleaved, ZB-H1, ZBV, DualPipeV - runs one real training step at pp 2 and 4 (forked gloo ranks, fp32, gpt2-tiny,
micro-batch 2 x 64 tokens, no dropout; 4 blocks at pp 2, 8 at pp 4: one block per virtual stage under the V),
measured as benchmarks/schedule_memory.py measures it (which prints the table): under the dry run's MemoryTracker
(parallel/simulation/fake_world.py), what the step created beyond the model states (activations and backward temporaries),
at its highest until the schedule ends (after it, the optimizer step's own temporaries, which the planner counts
elsewhere). Every rank within 10% of the planner's dry_run_report.planned(...)["activations"]; the same
measurement planned as another schedule (ZBV as 1F1B, ...) misses by more, so the check can fail.
"""

from __future__ import annotations

import random
from functools import cache

import pytest

from benchmarks.schedule_memory import CHUNKS, measure, write_recipe  # the measurement, imported before the fork
from megazoo.recipes.planner.activations import in_flight
from megazoo.recipes.dry_run.run import load, pipeline_depth_overrides
from megazoo.recipes.dry_run.report import planned
from megazoo.recipes.planner.schedule_memory import (ChunkBytes, actions, enough_micro_batches, peak_live, rank_peak,
                                                     walk)
from megazoo.recipes.planner.shards import shard_parameters

TOLERANCE = 0.10
WRONG = {name: "gpipe" if name == "1f1b" else "1f1b" for name in CHUNKS}  # planned as another schedule


@cache
def _measured(pp: int, folder) -> tuple[dict, list[dict]]:
    """Every schedule's step in one launch of pp ranks: {schedule: path}, [rank -> {schedule: bytes}]."""
    return measure(pp, list(CHUNKS), folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("schedule-memory")


@pytest.mark.parametrize("schedule", list(CHUNKS))
@pytest.mark.parametrize("pp", [2, 4])
def test_planned_activation_peak_matches_the_real_run(pp, schedule, folder):
    paths, per_rank = _measured(pp, folder)
    res = load(paths[schedule])
    wrong = load(paths[schedule], [f"parallel.schedule={WRONG[schedule]}", "parallel.virtual_stages=1"])
    misses = []
    for rank in range(pp):
        got = per_rank[rank][schedule]
        want = planned(res, rank)["activations"]
        assert abs(got / want - 1) <= TOLERANCE, (schedule, pp, rank, got, want)
        misses.append(abs(got / planned(wrong, rank)["activations"] - 1))
    assert max(misses) > TOLERANCE, (schedule, WRONG[schedule], misses)  # the check tells the schedules apart


@pytest.mark.parametrize("pp", [2, 4])
def test_zb_h1_peak_is_near_1f1bs_because_b_releases_the_graph(pp, folder):
    """Qi et al.'s ZB-H1 holds 1F1B's memory. Measured: the fullest rank's peak within 1.2x 1F1B's (1.13x at pp 2,
    1.10x at pp 4; keeping the graph from B to W measured 1.66x and 1.73x)."""
    _, per_rank = _measured(pp, folder)
    peak = {name: max(rank[name] for rank in per_rank) for name in ("1f1b", "zb_h1")}
    assert peak["zb_h1"] <= 1.2 * peak["1f1b"], peak


def test_zb_h1_plans_1f1bs_peak_at_the_papers_shape():
    """At Qi et al.'s kind of layout (megatron-8.3b, tp 8, pp 4, bf16, flash) a micro-batch waiting for W keeps
    less than a live one, and the last stages' pp waiting micro-batches stay under rank 0's 1F1B peak."""
    from megazoo.models.presets import get_preset
    from megazoo.recipes.planner.activations import ActivationSpec, stage_activations

    cfg = get_preset("megatron-8.3b")
    peak = {name: max(st.peak_bytes for st in stage_activations(
        cfg, 2048, 1, 8, [cfg.n_layer // 4] * 4, micro_batches=16, schedule=name,
        spec=ActivationSpec.for_model(cfg, 2, 1, True))) for name in ("1f1b", "zb_h1")}
    assert peak["zb_h1"] <= 1.01 * peak["1f1b"], peak


def test_in_flight_counts_come_from_the_lists():
    assert [in_flight("1f1b", 4, r, 16) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("zb_h1", 4, r, 16) for r in range(4)] == [4] * 4  # F to W: 1F1B's first stage's count
    assert in_flight("gpipe", 4, 3, 16) == 16 and in_flight("1f1b", 1, 0, 8) == 1 and in_flight("1f1b", 4, 0, 2) == 2
    for pp, v in ((2, 2), (4, 2), (4, 3)):  # the interleaved schedule's first stage: the paper's factor
        assert in_flight("interleaved", pp, 0, 4 * pp, v) == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))
    assert [peak_live("zbv", 16, 4, r, 2) for r in range(4)] == [8] * 4  # 2 pp half chunks
    assert [peak_live("dualpipev", 16, 4, r, 2) for r in range(4)] == [9] * 4  # 2 pp + 1


def test_cached_moments_equal_the_replay_and_zbv_prefix_holds_its_peak():
    rng = random.Random(0)
    for name, v in CHUNKS.items():
        for pp, m in ((2, 4), (3, 6), (4, 8)):
            for rank in range(pp):
                chunks = [ChunkBytes(rng.random(), 2 * rng.random(), rng.random()) for _ in range(v)]
                a, b = walk(actions(name, m, pp, rank, v), chunks), rank_peak(name, m, pp, rank, v, chunks)
                assert (a.held, a.peak) == pytest.approx((b.held, b.peak))
    from megazoo.parallel.pipeline.schedules import schedule
    for pp in (2, 3, 4):  # the planner walks zbv's first 4 pp micro-batches: the whole list's peak
        for m in range(1, 8 * pp + 1):
            for rank in range(pp):
                whole = walk(schedule("zbv", m, pp, rank), [ChunkBytes(2.0, 3.0, 0.5), ChunkBytes(1.0, 5.0, 0.5)])
                prefix = rank_peak("zbv", m, pp, rank, 2, [ChunkBytes(2.0, 3.0, 0.5), ChunkBytes(1.0, 5.0, 0.5)])
                assert (whole.held, whole.peak) == pytest.approx((prefix.held, prefix.peak)), (pp, m, rank)


def test_dry_run_depth_keeps_each_schedules_peak(tmp_path):
    """The dry run runs fewer micro-batches where the peak allows: enough for each schedule's (more than pp for
    the interleaved and V schedules; every one under GPipe)."""
    assert [enough_micro_batches(n, 64, 4, CHUNKS[n]) for n in CHUNKS] == [64, 4, 8, 4, 8, 8]
    path = write_recipe(tmp_path, 4, "dualpipev")
    path.write_text(path.read_text().replace("grad_accum = 8", "grad_accum = 32"))
    assert pipeline_depth_overrides(load(path)) == ["train.grad_accum=8", "train.global_batch=16"]


def test_v_placement_puts_embedding_and_head_on_the_first_rank():
    cfg = load("gpt2-117m").model
    stages = [[i] for i in range(8)]
    v = shard_parameters(cfg, 1, 4, stages, "v")
    loop = shard_parameters(cfg, 1, 4, stages)
    names = [{t.name for t in st.tensors} for st in v.stages]
    assert "ln_f.weight" in names[0] and "wte.weight" in names[0] and "wte.weight" not in names[3]
    assert [list(st.layers) for st in v.stages] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert v.stages[0].numel == loop.stages[0].numel + loop.stages[3].numel - loop.stages[1].numel \
        - cfg.padded_vocab(1) * cfg.d_model  # one word embedding for both ends
