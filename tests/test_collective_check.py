"""parallel.check_collectives (issue 32): a mismatched collective ends the job at once, naming both ranks and both
calls (torch's DETAIL debug level, parsed into one line), and the real training step raises no false alarm."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from harness import run_distributed
from recipe_helpers import tiny_resolved

from megazoo.parallel.collective_check import diagnose_mismatch
from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

TIMEOUT_S = 120.0


def _mismatched_call():
    """Three agreeing all-reduces, then rank 1 all-gathers while rank 0 all-reduces (the injected bug)."""
    x = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(x)
    start = time.perf_counter()
    try:
        if dist.get_rank() == 1:
            dist.all_gather_into_tensor(torch.empty(8), x)
        else:
            dist.all_reduce(x)
    except RuntimeError as err:
        return {"diagnosis": diagnose_mismatch(err), "seconds": time.perf_counter() - start}
    return {"diagnosis": None, "seconds": time.perf_counter() - start}


def test_mismatched_collective_names_both_ranks_and_calls():
    for result in run_distributed(_mismatched_call, 2, timeout_s=TIMEOUT_S, check_collectives=True):
        diagnosis = result["diagnosis"]
        assert diagnosis is not None and diagnosis.startswith("collectives diverged: ")
        assert "rank 0 in allreduce #3 (shape [4], Float)" in diagnosis
        assert "rank 1 in allgather_base #3 (shape [4], Float)" in diagnosis
        assert "\n" not in diagnosis
        assert result["seconds"] < TIMEOUT_S / 4  # ended by the check, not by the collective timeout


def test_other_errors_are_not_called_a_mismatch():
    assert diagnose_mismatch(RuntimeError("Timed out waiting 600000ms for recv")) is None


def _train_checked():
    res = tiny_resolved(parallel={"dp": 2, "tp": 2}, train={"steps": 2, "micro_batch": 2, "grad_accum": 2},
                        zero={"stage": 2})
    return Trainer(res, Topology.build(2, 2)).fit().losses


def test_training_step_passes_the_check():
    losses = run_distributed(_train_checked, 4, timeout_s=TIMEOUT_S, check_collectives=True)
    assert len(losses[0]) == 2 and all(run == losses[0] for run in losses)
