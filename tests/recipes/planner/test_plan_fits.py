"""`megazoo plan` with a GPU: the fits verdict and its exit codes, named GPUs, the micro-batch search, --search."""

from __future__ import annotations

import pytest

from megazoo.models.presets import get_preset
from megazoo.recipes.planner import cli as plan_cli
from megazoo.recipes.planner.cost_model import CostModel, search, step_time
from megazoo.recipes.planner.fit import Layout, device_memory, max_micro_batch
from megazoo.recipes.gpus import GPUS

DEMO = "recipes/demo.toml"


def run_cli(capsys, *argv):
    code = plan_cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_demo_recipe_fits_and_a_tiny_gpu_does_not(capsys):
    code, out, _ = run_cli(capsys, "--recipe", DEMO, "--gpu-memory", "32")
    assert code == 0 and "fits: yes" in out and "largest micro-batch" in out
    code, out, _ = run_cli(capsys, "--recipe", DEMO, "--gpu-memory", "0.001")
    assert code == 3 and "fits: no" in out and "over by" in out


def test_named_gpus(capsys):
    assert set(GPUS) >= {"v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb"}
    code, out, _ = run_cli(capsys, "--model", "gpt2-1.5b", "--dp", "8", "--zero", "1", "--micro-batch", "8",
                           "--gpu", "a100-80gb")
    assert code == 0 and "on a100-80gb" in out and "capacity 80.00 GB" in out
    code, out, _ = run_cli(capsys, "--model", "gpt2-1.5b", "--micro-batch", "8", "--gpu-memory", "v100-32gb")
    assert code == 3  # 16 bytes x 1.56B = 25 GB of states + activations of 8 x 1024 tokens, no ZeRO


@pytest.mark.parametrize("argv, needle", [
    (["--recipe", DEMO], "--gpu-memory GB"),
    (["--recipe", DEMO, "--gpu-memory", "big"], "valid GPUs"),
    (["--recipe", DEMO, "--gpu-memory", "32", "--gpu", "v100-32gb"], "not both"),
    (["--recipe", "no/such.toml", "--gpu-memory", "32"], "neither a file nor a shipped recipe"),
    (["--model", "gpt2-tiny", "--gpu-memory", "-1"], "> 0"),
    (["--search", "--model", "gpt2-tiny", "--gpu-memory", "32"], "--gpus"),
    (["--model", "tnlg-17b", "--tp", "8", "--gpu-memory", "32"], "28 attention heads"),
])
def test_bad_fit_flags_exit_2(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and err.startswith("megazoo plan: error:") and needle in err, err


def test_memory_grows_with_micro_batch_and_checkpointing_cuts_it():
    cfg = get_preset("tnlg-17b")
    lay = Layout(64, 4, 1, 1, 1, 1, 1024)
    mems = [device_memory(cfg, Layout(64, 4, 1, 1, b, 1, 1024), 32).total for b in (1, 2, 4)]
    assert mems[0] < mems[1] < mems[2]
    best = max_micro_batch(cfg, lay, 32)
    assert device_memory(cfg, Layout(64, 4, 1, 1, best, 1, 1024), 32).fits
    assert not device_memory(cfg, Layout(64, 4, 1, 1, best + 1, 1, 1024), 32).fits
    assert max_micro_batch(cfg, Layout(64, 4, 1, 1, 1, 1, 1024, checkpointing=True), 32) > best


def test_search_ranks_fitting_layouts_by_the_cost_model(capsys):
    cfg = get_preset("gpt2-1.5b")
    cm = CostModel.for_gpu(GPUS["v100-32gb"])
    found = search(cfg, 16, 32, cm, global_batch=512, seq_len=1024)
    assert found and all(c.memory.fits and c.layout.gpus == 16 and c.layout.global_batch == 512 for c in found)
    times = [c.time.total for c in found]
    assert times == sorted(times)
    # compute alone is the model FLOPs at the stated MFU; communication only adds
    lay = found[0].layout
    t = step_time(cfg, lay, found[0].memory.psi, cm)
    assert t.total >= t.compute > 0
    code, out, _ = run_cli(capsys, "--search", "--model", "gpt2-1.5b", "--gpus", "16", "--gpu", "v100-32gb",
                           "--mfu", "0.5", "--top", "5")
    assert code == 0 and "cost model:" in out and "MFU 0.5" in out and "GB/s" in out
    assert out.count("\n| ") == 6  # the header and 5 rows
    code, out, _ = run_cli(capsys, "--search", "--recipe", DEMO, "--gpus", "2", "--gpu-memory", "0.0001")
    assert code == 3 and "0 found" in out


def test_existing_planner_output_is_unchanged(capsys):
    code, out, _ = run_cli(capsys, "--params", "7.5e9", "--dp", "64", "--paper")
    assert code == 0 and "| 3 (P_os+g+p) | 0.234 | 0.234 | 1.41 | 1.88 |" in out and "fits:" not in out


def test_moe_plan_names_total_and_active_parameters(capsys):
    """An MoE preset's plan says how many parameters it holds and how many a token uses (FLOPs count those)."""
    code, out, _ = run_cli(capsys, "--model", "qwen3-30b-a3b", "--gpu-memory", "80")
    assert "model: 30,532,122,624 parameters, 3,353,032,704 active per token (8 of 128 experts)" in out
    code, out, _ = run_cli(capsys, "--model", "gpt2-1.5b", "--gpu-memory", "80")
    assert "active per token" not in out
