"""Pipeline parallelism trains the same function as one process, for every schedule and in full 3D."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved
from parity_helpers import assert_same_training, train_run

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]

TRAIN = {"micro_batch": 2, "grad_accum": 4}  # 4 pipeline micro-batches of 2 sequences: global batch 8


@functools.cache
def reference(n_layer: int):
    return train_run(tiny_resolved(train={"micro_batch": 8}, model={"n_layer": n_layer}), Topology.solo())


def _pipeline_run(parallel: dict, n_layer: int, zero: dict | None = None, train: dict = TRAIN):
    res = tiny_resolved(parallel=parallel, train=train, model={"n_layer": n_layer}, zero=zero or {})
    par = res.recipe.parallel

    def work():
        trainer = Trainer(res, Topology.build(par.dp, par.tp, par.pp))
        result = trainer.fit()
        wte = [c.wte.weight.detach().clone() for c in trainer.chunks if hasattr(c, "wte")]
        return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                "params": trainer.full_state_dict(), "wte": wte, "pp_rank": trainer.topo.pp_rank,
                "live": trainer.engine.stats.max_live_micro_batches}

    return run_distributed(work, res.world_size)


@pytest.mark.parametrize("pp, schedule, virtual, n_layer", [
    (2, "gpipe", 1, 4), (2, "1f1b", 1, 4), (2, "interleaved", 2, 4), (2, "zb_h1", 1, 4), (2, "zbv", 2, 4),
    (2, "dualpipev", 2, 4),
    (4, "gpipe", 1, 4), (4, "1f1b", 1, 4), (4, "interleaved", 2, 8), (4, "zb_h1", 1, 4), (4, "zbv", 2, 8),
    (4, "dualpipev", 2, 8),
])
def test_schedules_equal_reference(pp, schedule, virtual, n_layer):
    # dualpipev needs 2 pp - 1 micro-batches: 8 of one sequence at pp 4 (the same global batch of 8)
    train = {"micro_batch": 1, "grad_accum": 8} if (schedule, pp) == ("dualpipev", 4) else TRAIN
    results = _pipeline_run({"pp": pp, "schedule": schedule, "virtual_stages": virtual}, n_layer, train=train)
    for got in results:
        assert_same_training(got, reference(n_layer))
    if schedule == "1f1b":
        assert results[0]["live"] <= pp  # counted: the first stage never holds more than pp micro-batches
    if schedule == "gpipe":
        assert results[0]["live"] == train["grad_accum"]
    if schedule == "zb_h1":  # activations held from F to W: 1F1B's peak (pp micro-batches) on every rank
        assert max(r["live"] for r in results) == min(pp, TRAIN["grad_accum"])
    if schedule == "zbv":  # two half-size chunks: at most 2 pp chunk-micro-batches
        assert max(r["live"] for r in results) <= 2 * pp


ZERO_BUBBLE = [("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("schedule, virtual", ZERO_BUBBLE)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_bubble_with_dp2_zero_equals_reference(schedule, virtual, stage):
    """ZeRO 1-2 reduce the deferred weight gradients: their hooks fire in W (stage 2 per W, stage 1 in the
    last one). 4 micro-batches of 1 per dp rank: dualpipev needs 3 at pp 2."""
    results = _pipeline_run({"dp": 2, "pp": 2, "schedule": schedule, "virtual_stages": virtual}, 4,
                            zero={"stage": stage}, train={"micro_batch": 1, "grad_accum": 4})
    for got in results:
        assert_same_training(got, reference(4))


@pytest.mark.parametrize("schedule, virtual", ZERO_BUBBLE)
def test_zero_bubble_with_tp2_equals_reference(schedule, virtual):
    results = _pipeline_run({"tp": 2, "pp": 2, "schedule": schedule, "virtual_stages": virtual}, 4)
    for got in results:
        assert_same_training(got, reference(4))


@pytest.mark.parametrize("schedule, virtual", ZERO_BUBBLE)
def test_zero_bubble_with_activation_checkpointing_equals_reference(schedule, virtual):
    results = _pipeline_run({"pp": 2, "schedule": schedule, "virtual_stages": virtual}, 4,
                            train={**TRAIN, "activation_checkpointing": True})
    for got in results:
        assert_same_training(got, reference(4))


def test_tied_embedding_identical_on_first_and_last_stage():
    results = _pipeline_run({"pp": 4, "schedule": "1f1b"}, 4)
    first, last = results[0], results[3]
    assert (first["pp_rank"], last["pp_rank"]) == (0, 3)
    assert torch.equal(first["wte"][0], last["wte"][0])
    assert not results[1]["wte"] and not results[2]["wte"]  # middle stages hold no embedding


@pytest.mark.parametrize("stage", [1, 2])
def test_3d_dp2_tp2_pp2_with_zero_equals_reference(stage):
    results = _pipeline_run({"dp": 2, "tp": 2, "pp": 2, "schedule": "1f1b"}, 4, zero={"stage": stage},
                            train={"micro_batch": 2, "grad_accum": 2})
    for got in results:
        assert_same_training(got, reference(4))


@pytest.mark.parametrize("parallel, train, zero, message", [
    ({"pp": 5}, {}, {}, "parallel.pp = 5 is larger than the number of blocks"),
    ({"pp": 2, "schedule": "interleaved", "virtual_stages": 2}, {"grad_accum": 3}, {},
     "train.grad_accum = 3 (the pipeline's micro-batches) must be a multiple of parallel.pp = 2"),
    ({"pp": 2, "layers": [[0], [0, 1, 2, 3]]}, {}, {}, "every block 0..3 exactly once"),
    ({"pp": 2}, {}, {"stage": 3}, "zero.stage = 3 with parallel.pp > 1 is not supported"),
    ({"pp": 2, "virtual_stages": 2}, {}, {}, "needs parallel.schedule = 'interleaved'"),
    ({"pp": 2, "schedule": "zigzag"}, {}, {},
     "parallel.schedule = 'zigzag' is invalid; valid: 'gpipe', '1f1b', 'interleaved', 'zb_h1', 'zbv', 'dualpipev'"),
    ({"pp": 2, "schedule": "zbv", "virtual_stages": 3}, {}, {},
     "parallel.virtual_stages = 3 is invalid with parallel.schedule = 'zbv': it runs two chunks per rank, in a V; "
     "valid: 2, or leave virtual_stages unset"),
    ({"pp": 2, "schedule": "dualpipev", "virtual_stages": 1}, {"grad_accum": 4}, {},
     "parallel.virtual_stages = 1 is invalid with parallel.schedule = 'dualpipev'"),
    ({"pp": 1, "schedule": "zbv"}, {}, {}, "parallel.schedule = 'zbv' needs parallel.pp >= 2 (got pp = 1)"),
    ({"pp": 2, "schedule": "interleaved"}, {}, {}, "needs parallel.virtual_stages >= 2 and pp >= 2"),
    ({"pp": 2, "schedule": "zb_h1", "virtual_stages": 2}, {}, {}, "valid with gpipe/1f1b/zb_h1: 1"),
    ({"pp": 4, "schedule": "dualpipev", "virtual_stages": 2}, {"grad_accum": 4}, {},
     "train.grad_accum = 4 (the pipeline's micro-batches) must be at least 2 x parallel.pp - 1 = 7"),
])
def test_bad_pipeline_recipes_fail_before_training(parallel, train, zero, message):
    recipe = tiny_recipe(parallel=parallel, train=train, zero=zero, model={"n_layer": 4})
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(recipe)


@pytest.mark.parametrize("schedule, chunks", [("zbv", 2), ("dualpipev", 2), ("1f1b", 1), ("zb_h1", 1)])
def test_the_v_schedules_take_their_two_chunks_unasked(schedule, chunks):
    """zbv / dualpipev run two chunks per rank and nothing else: an unset parallel.virtual_stages is that 2, in the
    recipe every reader sees (a file or --set alike), and the stages are cut for it."""
    res = resolve(tiny_recipe(parallel={"pp": 2, "schedule": schedule}, train={"grad_accum": 4},
                              model={"n_layer": 4}))
    assert res.recipe.parallel.virtual_stages == chunks
    assert len(res.stage_layers) == 2 * chunks
    from_set = load_recipe(REPO / "recipes" / "demo.toml", ["parallel.pp=2", f"parallel.schedule={schedule}"])
    assert from_set.parallel.virtual_stages == chunks


def _save_then_resume(saved_with: dict, resumed_with: dict, run_dir: str, save_at: int = 5):
    """Train `save_at` steps under one schedule and save; a fresh Trainer under another schedule loads it and
    finishes the 10 steps."""
    def resolved(parallel: dict, name: str):
        return tiny_resolved(parallel=parallel, train=TRAIN, model={"n_layer": 4}, run={"dir": f"{run_dir}/{name}"})

    first = resolved(saved_with, "saved")
    topo = Topology.build(1, 1, 2)
    trainer = Trainer(first, topo)
    for step in range(save_at):
        trainer.train_step(step)
    trainer.save_checkpoint(save_at)
    resumed = Trainer(resolved(resumed_with, "resumed"), topo)
    start = resumed.load_checkpoint(f"{run_dir}/saved/checkpoints/step_{save_at:08d}")
    result = resumed.fit(start_step=start)
    return {"start": start, "losses": result.losses, "params": resumed.full_state_dict()}


@pytest.mark.parametrize("saved_with, resumed_with", [
    ({"pp": 2, "schedule": "1f1b"}, {"pp": 2, "schedule": "zbv", "virtual_stages": 2}),
    ({"pp": 2, "schedule": "zbv", "virtual_stages": 2}, {"pp": 2, "schedule": "zb_h1"}),
], ids=["1f1b-to-zbv", "zbv-to-zb_h1"])
def test_exact_resume_across_schedules(tmp_path, saved_with, resumed_with):
    """A checkpoint is topology-independent: saved under one schedule (and placement: zbv's V keeps the first and
    last stage, and one tied embedding, on rank 0), resumed under another, training ends where one process does."""
    ref = reference(4)
    for got in run_distributed(_save_then_resume, 2, saved_with, resumed_with, str(tmp_path)):
        assert got["start"] == 5
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][5:]), rtol=1e-10, atol=0)
        for name, value in ref["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-10, msg=name)
