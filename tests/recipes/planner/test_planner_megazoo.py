"""Issue 15 item 7: `megazoo plan` describes megazoo by default. The planner's megazoo_state_memory equals, byte
for byte, what the ZeRO optimizers hold (memory_bytes()) after training steps, for every stage 0-3 and every
precision (fp32, bf16, fp16) at dp = 2; the paper's formulas and DeepSpeed's buffers stay behind --paper."""

from __future__ import annotations

import json

import pytest
from harness import run_distributed
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.planner.zero import GB, megazoo_state_memory
from megazoo.recipes.planner import cli as plan_cli
from megazoo.recipes.training.trainer import Trainer

PRECISIONS = ("fp32", "bf16", "fp16")


def _measure():
    """On each of 2 dp ranks: every (precision, stage), and stages 1-3 with CPU offload, trained 2 steps with
    accumulation; what the optimizer holds and the padded parameter count of its buckets (stage 0: none)."""
    out = {}
    runs = [(p, s, "none") for p in PRECISIONS for s in range(4)] + [(p, s, "cpu") for p in ("fp32", "bf16")
                                                                     for s in (1, 2, 3)]
    for precision, stage, offload in runs:
        res = tiny_resolved(parallel={"dp": 2}, train={"micro_batch": 2, "grad_accum": 2, "steps": 2,
                                                       "precision": precision},
                            zero={"stage": stage, "reduce_bucket_size": 30_000, "offload": offload})
        trainer = Trainer(res, Topology.build(2, 1))
        trainer.fit()
        buckets = getattr(trainer.zero, "buckets", None)  # stages 1-3: padded to a multiple of dp each
        assert (stage == 0) == (buckets is None)
        psi = sum(b.flat_params.numel() for b in buckets) if buckets else \
            sum(p.numel() for p in trainer.model.parameters())
        out[f"{precision}/{stage}/{offload}"] = {"memory": trainer.zero.memory_bytes(), "psi": psi}
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_measure, 2)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plan_equals_measured(measured, stage, precision):
    _check(measured, stage, precision, "none")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_plan_equals_measured_with_cpu_offload(measured, stage, precision):
    _check(measured, stage, precision, "cpu")  # fp32 too keeps a separate master then (on the CPU)


def _check(measured, stage, precision, offload):
    for rank in measured:
        got = rank[f"{precision}/{stage}/{offload}"]
        plan = megazoo_state_memory(got["psi"], 2, stage, precision, offload=offload == "cpu")
        assert got["memory"] == {"params": plan.params_bytes, "grads": plan.grads_bytes,
                                 "optimizer": plan.optimizer_bytes}, (stage, precision, offload)


def test_bytes_per_parameter_are_megazoos():
    psi, n = 1_000_000, 4
    per = {(p, s): megazoo_state_memory(psi, n, s, p).total_bytes / psi for p in ("bf16", "fp32") for s in range(4)}
    assert per["bf16", 0] == per["fp32", 0] == 16  # stage 0 keeps fp32 storage under autocast
    assert per["bf16", 1] == 2 + 2 + 16 / n and per["bf16", 2] == 2 + 16 / n and per["bf16", 3] == 18 / n
    assert per["fp32", 1] == 8 + 12 / n and per["fp32", 2] == 4 + 12 / n and per["fp32", 3] == 16 / n
    off = megazoo_state_memory(psi, n, 2, "bf16", offload=True)
    assert off.cpu_bytes == 16 * psi / n and off.device_bytes == 2 * psi  # masters, moments, owned grads


def test_cli_defaults_to_megazoo_and_keeps_the_paper_behind_a_flag(capsys):
    assert plan_cli.main(["--params", "7.5e9", "--dp", "64", "--json"]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert mine["inputs"]["planner"] == "megazoo" and mine["inputs"]["precision"] == "bf16"
    assert mine["inputs"]["buffers"]["reduce_bucket"] == 1 << 24  # recipes' zero.reduce_bucket_size default
    assert mine["stages"][3]["total_bytes"] == 18 * 7.5e9 / 64
    assert plan_cli.main(["--params", "7.5e9", "--dp", "64", "--json", "--paper"]) == 0
    paper = json.loads(capsys.readouterr().out)
    assert paper["stages"][3]["total_bytes"] / GB == 1.875 and paper["inputs"]["buffers"]["reduce_bucket"] == 5e8
    assert plan_cli.main(["--params", "1e9", "--prefetch", "5e7"]) == 2
    assert "--prefetch is a DeepSpeed buffer" in capsys.readouterr().err
    assert plan_cli.main(["--params", "1e9", "--k", "16"]) == 2
    assert "add --paper" in capsys.readouterr().err
    assert plan_cli.main(["--model", "gpt2-117m", "--dp", "2", "--precision", "fp32", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "what megazoo's optimizers hold, fp32 training" in out and "gathered units" in out
