"""The core promise: every (dp, tp) layout trains the same function as the single-process reference.

Each layout runs the real Trainer (recipes/training/trainer.py) for 10 steps with clipping and warmup active and returns
its per-step losses, grad norms and full parameters; all must equal the reference's within reduction-order
rounding. The recipes run in fp64 (tests/recipe_helpers.py), so that rounding is ~1e-15 and the tolerances 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from parity_helpers import assert_same_training, train_run
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology

def _train_on_ranks(parallel: dict, train: dict | None = None, zero: dict | None = None):
    res = tiny_resolved(parallel=parallel, train=train or {}, zero=zero or {})

    def work():
        return train_run(res, Topology.build(res.recipe.parallel.dp, res.recipe.parallel.tp))

    return run_distributed(work, res.world_size)


@pytest.fixture(scope="module")
def reference():
    """One process, micro-batch 8, no accumulation: the fp64 reference every layout below is held to."""
    return train_run(tiny_resolved(train={"micro_batch": 8}), Topology.solo())


def test_reference_learns_and_clips(reference):
    losses = reference["losses"]
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert max(reference["norms"]) > 0.5  # grad_clip = 0.5 is active on some steps


def test_grad_accumulation_equals_bigger_batch(reference):
    got = train_run(tiny_resolved(train={"micro_batch": 4, "grad_accum": 2}), Topology.solo())
    assert_same_training(got, reference)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_reference(reference, tp):
    results = _train_on_ranks({"tp": tp}, {"micro_batch": 8})
    for got in results:
        assert_same_training(got, reference)


def test_data_parallel_equals_reference(reference):
    results = _train_on_ranks({"dp": 2}, {"micro_batch": 4})
    for got in results:
        assert_same_training(got, reference)


def test_dp2_tp2_with_accumulation_equals_reference(reference):
    results = _train_on_ranks({"dp": 2, "tp": 2}, {"micro_batch": 2, "grad_accum": 2})
    for got in results:
        assert_same_training(got, reference)


def test_fp32_dp2_tp2_matches_fp32_reference():
    """The same check in fp32, the precision of real CPU runs: losses within rel 1e-5; parameters within 1e-4
    (fp32 reduction-order rounding of near-zero gradients is amplified by Adam's normalisation, up to ~lr)."""
    fp32 = {"precision": "fp32"}
    ref = train_run(tiny_resolved(train={"micro_batch": 8, **fp32}), Topology.solo())
    for got in _train_on_ranks({"dp": 2, "tp": 2}, {"micro_batch": 4, **fp32}):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        for name, value in ref["params"].items():
            assert value.dtype == torch.float32
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_dp2_with_accumulation_equals_reference(reference, stage):
    results = _train_on_ranks({"dp": 2}, {"micro_batch": 2, "grad_accum": 2}, zero={"stage": stage,
                                                                                 "reduce_bucket_size": 40_000})
    for got in results:
        assert_same_training(got, reference)
