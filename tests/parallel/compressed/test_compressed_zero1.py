"""1-bit Adam and 0/1 Adam at ZeRO stage 1 (parallel/compressed/zero1.py) against their stage-0 versions: the
same losses and parameters (fp64, 1e-10) over the warm-up, the compressed phase and 0/1 Adam's local steps, at
dp 2 and 4; the optimizer-state bytes per rank each saves (printed: pytest -s); exact resume; stages 2-3 refused."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

ONEBIT = {"name": "onebit_adam", "freeze_step": 3}
# warm-up 0-2, "onebit_grad" 3, "var" 4, then local steps: sync 5, local 6, 7, sync 8 (interval 2), last 9 syncs
ZERO_ONE = {"name": "zero_one_adam", "freeze_step": 3, "var_freeze_step": 5, "local_step_scaler": 1,
            "local_step_clipper": 2}
STEPS = 10
SMALL = {"n_layer": 1, "d_model": 32, "n_head": 2}  # the arithmetic is per element: a small model covers it


def _run(stage: int, optimizer: dict, dp: int):
    res = tiny_resolved(model=SMALL, parallel={"dp": dp}, train={"steps": STEPS, "micro_batch": 2, "seq_len": 16},
                        optimizer=optimizer, zero={"stage": stage})
    trainer = Trainer(res, Topology.build(dp, 1))
    losses, memory = [], []
    for step in range(STEPS):
        losses.append(trainer.train_step(step)["loss"])
        memory.append(trainer.zero.memory_bytes()["optimizer"])
    return losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}, memory


def _all(dp: int):
    return [(_run(0, optimizer, dp), _run(1, optimizer, dp)) for optimizer in (ONEBIT, ZERO_ONE)]


@pytest.mark.parametrize("dp", [2, 4])
def test_stage1_equals_stage0(dp):
    for per_rank in run_distributed(_all, dp, dp):
        for optimizer, ((losses0, params0, memory0), (losses1, params1, memory1)) in zip((ONEBIT, ZERO_ONE), per_rank):
            assert losses1 == pytest.approx(losses0, rel=0, abs=1e-10), optimizer["name"]
            assert losses0[-1] < losses0[0]
            for key, value in params0.items():
                torch.testing.assert_close(params1[key], value, rtol=0, atol=1e-10, msg=key)
    for optimizer, (run0, run1) in zip((ONEBIT, ZERO_ONE), per_rank):
        memory0, memory1 = run0[2], run1[2]
        # optimizer-state bytes per rank after the warm-up (step 2), compressed phase (step 4), at the end
        report = {at: (memory0[at], memory1[at], round(memory0[at] / memory1[at], 3)) for at in (2, 4, STEPS - 1)}
        print(f"\n{optimizer['name']} dp={dp} optimizer bytes per rank {{step: (stage 0, stage 1, ratio)}}: {report}")
        assert memory1[2] < memory0[2] and memory1[4] < memory0[4]
        if optimizer["name"] == "onebit_adam":  # m as sign bytes, v a 1/dp chunk: only the worker error stays full
            assert memory1[STEPS - 1] < memory0[STEPS - 1]


def _resume(optimizer: dict, steps: int, save_at: int, run_dir: str):
    res = tiny_resolved(model=SMALL, parallel={"dp": 2}, train={"steps": steps, "micro_batch": 2, "seq_len": 16},
                        optimizer=optimizer, zero={"stage": 1}, run={"dir": run_dir},
                        checkpoint={"every": save_at, "keep": 3})
    topo = Topology.build(2, 1)
    straight = Trainer(res, topo)
    full = straight.fit()
    resumed = Trainer(res, topo)
    start = resumed.load_checkpoint(f"{run_dir}/checkpoints/step_{save_at:08d}")
    tail = resumed.fit(start_step=start)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    return start, full.losses[save_at:], tail.losses, all(torch.equal(a[k], b[k]) for k in a)


def _resumes(run_dir: str):
    return [_resume(ONEBIT, 6, 4, f"{run_dir}/onebit"),  # saved in the compressed phase: m kept as sign bytes
            _resume(ZERO_ONE, 10, 7, f"{run_dir}/zero_one")]  # between two syncs: the diverged replicas


def test_stage1_exact_resume(tmp_path):
    for per_rank in run_distributed(_resumes, 2, str(tmp_path)):
        for start, expected, got, same_params in per_rank:
            assert got == expected and same_params
        assert [r[0] for r in per_rank] == [4, 7]


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_2_3_refused(stage):
    with pytest.raises(RecipeError) as err:
        resolve(tiny_recipe(optimizer={"name": "onebit_adam"}, zero={"stage": stage}))
    assert "needs zero.stage = 0 or 1" in str(err.value) and f"got zero.stage = {stage}" in str(err.value)
