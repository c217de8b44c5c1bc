"""1-bit Adam and 0/1 Adam (parallel/compressed/) in the Trainer: AdamW exactly during the warm-up, the bytes they
send per step, 0/1 Adam's skipped rounds, exact resume, and recipes refused before start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved

from megazoo.parallel.compressed.comms import padded_numel
from megazoo.parallel.compressed.packing import wire_bytes
from megazoo.parallel.compressed.schedule import CompressionSettings, Schedule
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
# 0/1 Adam's whole policy in 10 steps: warm-up (0-2), a compressed-gradient step (3), a variance step (4), then
# local steps with the interval 1, 2, 4 (capped): sync at 5, local at 6, 7, 8, and the last step (9) always syncs.
ZERO_ONE = {"name": "zero_one_adam", "freeze_step": 3, "var_freeze_step": 5, "local_step_scaler": 1,
            "local_step_clipper": 4}
ZERO_ONE_KINDS = ["adamw"] * 3 + ["onebit_grad", "var", "sync", "local", "local", "local", "sync"]


def _run(res):
    trainer = Trainer(res, Topology.build(res.recipe.parallel.dp, res.recipe.parallel.tp))
    records = [trainer.train_step(step) for step in range(res.recipe.train.steps)]
    return {"losses": [r["loss"] for r in records], "bytes": [r["comm_bytes"] for r in records],
            "params": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "numels": [f.numel() for f in trainer.zero.gradients()]}


def _warmup_runs(parallel: dict):
    base = {"steps": 4, "micro_batch": 4}
    out = {}
    for name, optimizer in (("adamw", {}), ("onebit_adam", {"name": "onebit_adam", "freeze_step": 4}),
                            ("zero_one_adam", {"name": "zero_one_adam", "freeze_step": 4, "var_freeze_step": 4})):
        if name == "zero_one_adam" and parallel.get("tp", 1) > 1:
            continue  # the same warm-up code path: one optimizer is enough to show tp composes
        out[name] = _run(tiny_resolved(parallel=parallel, train=base, optimizer=optimizer))
    return out


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"dp": 2, "tp": 2}], ids=["dp2", "dp2-tp2"])
def test_warmup_equals_adamw_exactly(parallel):
    """Stage-0 AdamW vs 1-bit Adam and 0/1 Adam for freeze_step steps (fp64): bit-identical."""
    for got in run_distributed(_warmup_runs, parallel["dp"] * parallel.get("tp", 1), parallel):
        reference = got.pop("adamw")
        for name, run in got.items():
            assert run["losses"] == reference["losses"], name
            assert run["bytes"] == reference["bytes"], name  # the same full-precision all-reduce
            for key, value in reference["params"].items():
                assert torch.equal(run["params"][key], value), (name, key)


def _compressed_runs():
    train = {"steps": 5, "micro_batch": 4, "precision": "fp32"}
    onebit = _run(tiny_resolved(parallel={"dp": 2}, train=train, optimizer={"name": "onebit_adam", "freeze_step": 3}))
    zero_one = _run(tiny_resolved(parallel={"dp": 2}, train={**train, "steps": 10}, optimizer=ZERO_ONE))
    return onebit, zero_one


def test_bytes_per_step_and_skipped_rounds():
    """fp32 at dp = 2: after the warm-up 1-bit Adam sends its momentum as packed signs (one all-to-all + one
    all-gather per bucket: >= 16x fewer bytes than the all-reduce); 0/1 Adam's local steps send nothing."""
    assert [Schedule(CompressionSettings(**ZERO_ONE, last_step=9)).kind(s) for s in range(10)] == ZERO_ONE_KINDS
    for onebit, zero_one in run_distributed(_compressed_runs, 2):
        full = sum(2 * n * 4 * (2 - 1) / 2 for n in onebit["numels"])  # ring all-reduce, fp32
        compressed = sum(2 * (2 - 1) * wire_bytes(padded_numel(n, 2) // 2, torch.float32) for n in onebit["numels"])
        assert onebit["bytes"] == [full] * 3 + [compressed] * 2
        assert full / compressed >= 16
        assert onebit["losses"][-1] < onebit["losses"][0]
        expected = {"adamw": full, "var": full, "onebit_grad": compressed, "sync": compressed, "local": 0.0}
        assert zero_one["bytes"] == [expected[kind] for kind in ZERO_ONE_KINDS]
        assert zero_one["losses"][-1] < zero_one["losses"][0]


def _resume(optimizer: dict, steps: int, save_at: int, run_dir: str):
    """Uninterrupted run (checkpoint at save_at) vs a fresh Trainer that loads it and finishes: bit-identical."""
    res = tiny_resolved(parallel={"dp": 2}, train={"steps": steps, "micro_batch": 4, "precision": "fp32"},
                        optimizer=optimizer, run={"dir": run_dir}, checkpoint={"every": save_at, "keep": 3})
    topo = Topology.build(2, 1)
    straight = Trainer(res, topo)
    full = straight.fit()
    resumed = Trainer(res, topo)
    start = resumed.load_checkpoint(f"{run_dir}/checkpoints/step_{save_at:08d}")
    tail = resumed.fit(start_step=start)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    diverged = resumed.zero.rank_state()["diverged"]
    return start, full.losses[save_at:], tail.losses, all(torch.equal(a[k], b[k]) for k in a), a, diverged


@pytest.mark.parametrize("optimizer, steps, save_at", [
    ({"name": "onebit_adam", "freeze_step": 3}, 6, 4),
    (ZERO_ONE, 10, 7),  # saved between two syncs: the ranks' parameters and momenta differ there
], ids=["onebit", "zero_one_between_syncs"])
def test_exact_resume(tmp_path, optimizer, steps, save_at):
    results = run_distributed(_resume, 2, optimizer, steps, save_at, str(tmp_path))
    for start, expected, got, same_params, _, diverged in results:
        assert start == save_at and got == expected and same_params
        assert not diverged  # the last step synchronised
    for key, value in results[0][4].items():  # ... so both replicas end identical
        assert torch.equal(value, results[1][4][key]), key


@pytest.mark.parametrize("sections, message", [
    ({"optimizer": {"name": "lion"}}, "optimizer.name = 'lion' is invalid; valid: 'adamw', 'onebit_adam', "
                                      "'zero_one_adam'"),
    ({"optimizer": {"name": "onebit_adam"}, "zero": {"stage": 2}}, "needs zero.stage = 0"),
    ({"optimizer": {"name": "onebit_adam"}, "parallel": {"pp": 2}}, "parallel.pp = 2 is not supported"),
    ({"optimizer": {"name": "onebit_adam", "freeze_step": 0}}, "optimizer.freeze_step = 0 is invalid"),
    ({"optimizer": {"name": "zero_one_adam", "freeze_step": 10, "var_freeze_step": 5}},
     "optimizer.var_freeze_step = 5 is smaller than optimizer.freeze_step = 10"),
    ({"optimizer": {"name": "zero_one_adam", "local_step_clipper": 0}}, "optimizer.local_step_clipper = 0"),
])
def test_bad_optimizer_recipes_are_refused(sections, message):
    with pytest.raises(RecipeError) as err:
        resolve(tiny_recipe(**sections))
    assert message in str(err.value)


def test_cli_refuses_before_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megazoo.recipes.cli", "train", str(REPO / "recipes" / "demo.toml"),
                          "--set", "optimizer.name=onebit_adam", "--set", f"run.dir={tmp_path / 'run'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "optimizer.name = 'onebit_adam' needs zero.stage = 0" in out.stderr  # demo.toml runs ZeRO stage 2
    assert not (tmp_path / "run").exists()
