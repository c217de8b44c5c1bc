"""`megazoo verify`: shipped recipes (and overrides that reach the features no shipped recipe has at a cheap size)
pass against one process in fp64; an injected layout bug fails naming the quantity; bad input exits 2 first.

Together the runs below cover every feature verify exercises: dp + ZeRO-2 (demo), tp (demo_tp2), cp with ring
attention + ZeRO-1 + accumulation (long-context), tp x dp + activation checkpointing + fp16 loss scaling
(tnlg-17b), ZeRO-3, the interleaved pipeline schedule, 1-bit Adam's warm-up and ZeRO-Offload (demo overrides),
fine-tuning rows with LoRA (sft-demo: synthetic packed SFT rows, since its data is made by `make sft-demo`),
expert parallelism with the router's aux loss (moe-demo).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from verify_helpers import plant_tp_input_grad_bug

from megazoo.recipes import cli
from megazoo.recipes.training import trainer as trainer_module
from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.config import load_recipe
from megazoo.recipes.verify import compare
from megazoo.recipes.verify.shrink import plan

PASSING = {
    "demo": ["demo"],
    "demo_tp2": ["demo_tp2"],
    "long-context": ["long-context"],
    "tnlg-17b": ["tnlg-17b"],
    "zero3": ["demo", "--set", "zero.stage=3"],
    "interleaved": ["demo", "--set", "parallel.dp=1", "--set", "parallel.pp=2", "--set",
                    "parallel.schedule=interleaved", "--set", "parallel.virtual_stages=2", "--set",
                    "train.grad_accum=4"],
    "onebit": ["demo", "--set", "zero.stage=0", "--set", "optimizer.name=onebit_adam"],
    "offload": ["demo", "--set", "zero.stage=1", "--set", "zero.offload=cpu"],
    "sft-demo": ["sft-demo"],
    "moe-demo": ["moe-demo"],  # ep 2: the experts over both ranks, the one process on the same micro-batches
    "qwen3-30b-a3b-full-ft": ["qwen3-30b-a3b-full-ft"],  # ep 2 x ZeRO-3, accumulation, checkpointing
    "qwen3-30b-a3b-lora": ["qwen3-30b-a3b-lora"],  # ep 2 with LoRA on the attention, ZeRO-1
    "deepseek-demo": ["deepseek-demo"],  # sigmoid + bias in groups (shrunk to 2 of 4 experts), MTP, ep 2
    "deepseek-v3": ["deepseek-v3"],  # MLA, YaRN, pp x ep with a stage of dense layers only, one MTP module
    "kimi-k2": ["kimi-k2"],
    "window-cp": ["llama-demo", "--set", "model.sliding_window=8", "--set", "parallel.tp=1", "--set", "parallel.cp=2",
                  "--set", "parallel.cp_attention=all_to_all"],  # Mistral's window (8 < 32 tokens) under cp
}


@pytest.mark.parametrize("name", PASSING)
def test_layout_passes(name, tmp_path, capsys):
    out_json = tmp_path / "verify.json"
    code = cli.main(["verify", *PASSING[name], "--steps", "2", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert code == 0, text
    record = json.loads(out_json.read_text())
    assert record["passed"] and record["steps"] == 2
    names = [q["name"] for q in record["quantities"]]
    assert names == ["loss", "gradient norm (before clipping)", "validation loss (after the last step)",
                     "parameters (final, full)"]
    assert all(q["max_deviation"] <= 1e-10 and q["tolerance"] == 1e-10 for q in record["quantities"])
    assert "PASS" in text and "exercised:" in text and "shrunk:" in text


def test_output_names_features_and_shrunk_degrees(capsys):
    assert cli.main(["verify", "tnlg-17b", "--steps", "2"]) == 0
    text = capsys.readouterr().out
    for line in ("data parallel dp=2", "tensor parallel tp=2", "ZeRO stage 1", "activation checkpointing",
                 "fp16 dynamic loss scaling", "parallel.dp: 64 -> 2", "parallel.tp: 4 -> 2",
                 "model.n_layer: 78 -> 2", "model.n_head: 28 -> 4", "train.precision: 'fp16' -> 'fp64'"):
        assert line in text, line


def test_injected_tp_bug_fails_naming_the_quantity(monkeypatch, tmp_path, capsys):
    plant_tp_input_grad_bug(monkeypatch)
    out_json = tmp_path / "verify.json"
    assert cli.main(["verify", "demo_tp2", "--steps", "2", "--json", str(out_json)]) == 1
    text = capsys.readouterr().out
    record = {q["name"]: q for q in json.loads(out_json.read_text())["quantities"]}
    # The forward is right, so the first loss agrees; the gradients (and then everything after) do not.
    assert not record["gradient norm (before clipping)"]["passed"]
    assert not record["parameters (final, full)"]["passed"]
    assert "FAIL: the layout does not compute the same function: loss, gradient norm" in text


def test_injected_rank_gradient_bug_fails(monkeypatch, capsys):
    """A data-parallel bug: rank 1's reduced gradients are off by 1e-6 (relative) before the step (ZeRO-2, dp = 2)."""
    real = trainer_module.optimizer_step

    def perturbed(zero, **kwargs):
        if dist.is_initialized() and dist.get_rank() == 1:  # the reference runs without a process group
            zero.finish_gradients()
            for grad in zero.gradients():
                grad.mul_(1 + 1e-6)
        return real(zero, **kwargs)

    monkeypatch.setattr(trainer_module, "optimizer_step", perturbed)  # inherited by the forked ranks
    assert cli.main(["verify", "demo", "--steps", "2"]) == 1
    text = capsys.readouterr().out
    assert "FAIL: the layout does not compute the same function" in text and "parameters (final, full)" in text


@pytest.mark.parametrize("args, needle", [
    (["demo_tp2", "--set", "parallel.tp=3"], "tp"),
    (["demo", "--set", "train.bogus=1"], "train.bogus"),
    (["no-such-recipe"], "neither a file nor a shipped recipe"),
    (["demo", "--set", "zero.stage=3", "--set", "parallel.pp=2"], "zero.stage = 3"),
])
def test_bad_input_exits_2_before_any_process(monkeypatch, capsys, args, needle):
    def refuse(*a, **k):
        raise AssertionError("a process was started for bad input")

    monkeypatch.setattr(compare, "run_distributed", refuse)
    monkeypatch.setattr(compare, "_train", refuse)
    assert cli.main(["verify", *args]) == 2
    assert needle in capsys.readouterr().err


def test_bad_steps_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["verify", "demo", "--steps", "0"])
    assert exit_info.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_injected_mismatched_collective_is_named(monkeypatch, capsys):
    """A layout bug that makes ranks call different collectives: named at once (collective fingerprints)."""
    real = trainer_module.optimizer_step

    def mismatched(zero, **kwargs):
        if dist.is_initialized() and dist.get_rank() == 1:
            dist.broadcast(torch.zeros(3, dtype=torch.float64), src=0)  # rank 0 goes on to its optimizer step
        return real(zero, **kwargs)

    monkeypatch.setattr(trainer_module, "optimizer_step", mismatched)
    assert cli.main(["verify", "demo_tp2", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "FAIL: the layout did not run: collectives diverged: " in err
    assert "rank 1 in broadcast" in err and "rank 0 in " in err


@pytest.mark.parametrize("name", ["llama3.1-405b", "llama-70b-full-ft", "llama-405b-full-ft"])
def test_grouped_query_recipes_shrink_and_stay_grouped(name):
    """Llama 3's 128 (405B) / 64 (70B) query heads share 8 kv heads: the shrunk model keeps attention grouped
    (2 query heads per kv head, split over tp) instead of failing with "n_kv_head = 8 does not divide n_head = 4"."""
    layout = plan(load_recipe(find_recipe(name)), steps=2).layout
    assert layout.model.n_kv_head < layout.model.n_head and layout.model.n_head % layout.model.n_kv_head == 0
    assert layout.model.n_kv_head % layout.recipe.parallel.tp == 0


def test_a_fine_tuning_recipe_runs_on_synthetic_rows_and_leaves_nothing(monkeypatch, tmp_path, capsys):
    """sft-demo's data does not exist here: verify writes synthetic SFT rows (train and validation) into a folder
    of its own, runs both sides on them, names them in its output and removes the folder afterwards."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert cli.main(["verify", "sft-demo", "--steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "sft: synthetic fine-tuning rows" in text and "fine-tuning rows (packed, response-only loss" in text
    assert "LoRA rank 8" in text
    assert list(tmp_path.iterdir()) == []


def test_injected_fine_tuning_weighting_bug_fails(monkeypatch, capsys):
    """Micro-batches of fine-tuning rows weighted equally instead of by their response tokens: dp 2 then trains
    on another loss than one process (its micro-batches hold other rows' tokens), and verify says so."""
    from megazoo.data.sft.packing import SFTRows

    monkeypatch.setattr(SFTRows, "micro_batch_weights",
                        lambda self, step_rows, micro_batches, replicas: [1.0] * len(micro_batches))
    assert cli.main(["verify", "sft-demo", "--steps", "2"]) == 1
    text = capsys.readouterr().out
    assert "FAIL: the layout does not compute the same function" in text and "loss" in text


def test_group_limited_routing_shrinks_to_groups_that_divide_the_experts():
    """deepseek-v3's 8 groups of 256 experts (a token's from 4): the shrunk model's 4 experts in 2 groups, a token's
    from 1, instead of "moe_n_group = 8 must divide model.n_experts = 4" while planning the check."""
    model = plan(load_recipe(find_recipe("deepseek-v3")), steps=2).layout.model
    assert (model.n_experts, model.moe_n_group, model.moe_topk_group, model.moe_router) == (4, 2, 1, "sigmoid_bias")
    assert model.mtp_depth == 1  # the recipe's multi-token prediction module is checked with the rest
