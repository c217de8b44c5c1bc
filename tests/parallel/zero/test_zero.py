"""ZeRO stages 1 and 2: parity with the reference in more layouts, and the memory they actually hold."""

from __future__ import annotations

import pytest
from harness import run_distributed
from parity_helpers import assert_same_training, train_run, zero_run
from recipe_helpers import tiny_recipe, tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.planner.zero import FP32_ADAM, model_state_memory
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer


@pytest.fixture(scope="module")
def reference():
    return train_run(tiny_resolved(train={"micro_batch": 8}), Topology.solo())


def test_zero2_dp2_tp2_equals_reference(reference):
    for got in zero_run({"dp": 2, "tp": 2}, {"micro_batch": 4}, {"stage": 2, "reduce_bucket_size": 30_000}):
        assert_same_training(got, reference)


def test_zero1_dp4_with_accumulation_equals_reference(reference):
    for got in zero_run({"dp": 4}, {"micro_batch": 1, "grad_accum": 2}, {"stage": 1}):
        assert_same_training(got, reference)


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_state_is_partitioned(stage):
    """Each of 4 dp ranks holds a quarter of the fp32 masters and Adam moments (3 x params / 4, plus padding);
    stage 2 also holds only its quarter of the gradients between steps, stage 1 the full gradient buffers."""
    results = zero_run({"dp": 4}, {"micro_batch": 1, "grad_accum": 2, "precision": "fp32"},
                        {"stage": stage, "reduce_bucket_size": 50_000}, steps=2)
    # fp32 training needs no separate master: the owned chunk of the bucket is its own master (aliased), so the
    # optimizer holds only the Adam moments, K = 8 (planner.FP32_ADAM), with 4-byte params and grads.
    state = FP32_ADAM
    for got in results:
        n, mem = got["n_params"], got["memory"]
        per_rank = n / 4
        plan = model_state_memory(n, 4, stage, state)
        assert mem["params"] == pytest.approx(plan.params_bytes, rel=0.01)
        assert mem["optimizer"] == pytest.approx(plan.optimizer_bytes, rel=0.01)
        # stage 1 holds the planned full gradient plus the owned fp32 chunk it reduces into (a documented buffer)
        owned_chunk = 4 * per_rank if stage == 1 else 0
        assert mem["grads"] - owned_chunk == pytest.approx(plan.grads_bytes, rel=0.01)
        assert mem["params"] >= 4 * n and mem["params"] <= 4 * (n + 64)  # full fp32 params (+ padding)
        assert 2 * 4 * per_rank <= mem["optimizer"] <= 2 * 4 * (per_rank + 64)
        if stage == 2:
            assert not any(got["full_grads"])  # full-size gradient buffers freed after reduction
            assert 4 * per_rank <= mem["grads"] <= 4 * (per_rank + 64)
        else:
            assert all(got["full_grads"])
            assert mem["grads"] >= 4 * (n + per_rank)


def test_zero_stage_must_exist():
    with pytest.raises(RecipeError, match=r"zero.stage = 4 is invalid; valid: 0, 1, 2, 3"):
        resolve(tiny_recipe(zero={"stage": 4}))


def test_zero3_solo_equals_reference(reference):
    assert_same_training(train_run(tiny_resolved(train={"micro_batch": 8}, zero={"stage": 3}), Topology.solo()),
                         reference)


@pytest.mark.parametrize("parallel, train", [
    ({"dp": 2}, {"micro_batch": 2, "grad_accum": 2}),
    ({"dp": 2, "tp": 2}, {"micro_batch": 4}),
    ({"dp": 4}, {"micro_batch": 1, "grad_accum": 2, "activation_checkpointing": True}),
])
def test_zero3_equals_reference(reference, parallel, train):
    for got in zero_run(parallel, train, {"stage": 3}):
        assert_same_training(got, reference)


def test_zero3_holds_a_quarter_of_the_model_state_at_dp4():
    """Between steps a stage-3 rank holds only its chunks: params, grads and optimizer states are a quarter of
    stage 0's (fp32: 4 + 4 + 8 bytes per parameter -> (4 + 4 + 8) / 4; the owned parameter chunk is its own
    fp32 master, so there is no 12-byte K and no 20 B / parameter)."""
    for got in zero_run({"dp": 4}, {"micro_batch": 1, "grad_accum": 2, "precision": "fp32"}, {"stage": 3},
                         steps=2):
        n, mem = got["n_params"], got["memory"]
        plan = model_state_memory(n, 4, 3, FP32_ADAM)
        stage0 = model_state_memory(n, 4, 0, FP32_ADAM)
        assert not any(got["full_grads"])
        for kind in ("params", "grads", "optimizer"):
            assert mem[kind] == pytest.approx(getattr(plan, f"{kind}_bytes"), rel=0.01), kind
        assert sum(mem.values()) == pytest.approx(stage0.total_bytes / 4, rel=0.01)


def _diverging_ranks(how: str):
    """dp rank 1 skips the first block (or runs it without using its parameters): ZeRO-3 must say so instead
    of hanging or crashing in mismatched collectives."""
    res = tiny_resolved(parallel={"dp": 2}, train={"micro_batch": 4}, zero={"stage": 3})
    topo = Topology.build(2, 1)
    trainer = Trainer(res, topo)
    if topo.dp_rank == 1:
        if how == "skip":
            del trainer.model.h["0"]
        else:
            trainer.model.h["0"].forward = lambda x: x * 1.0
    try:
        trainer.train_step(0)
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("how", ["skip", "unused"])
def test_zero3_different_module_sequences_fail_clearly(how):
    for msg in run_distributed(_diverging_ranks, 2, how):
        assert "different module sequences" in msg and "h.0" in msg, msg
