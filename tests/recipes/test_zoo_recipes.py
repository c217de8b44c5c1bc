"""The zoo's recipes at their published setups: each resolves at its real size and fits its target GPU.

Every recipe is named here with its published layout (tests/recipes/test_recipes.py resolves every recipes/*.toml too);
the planner (recipes/planner/fit.py) must say it fits the GPU of its header, and `megazoo plan --recipe ... --gpu-memory`
must print `fits: yes` and exit 0. The trillion-parameter claim is checked both ways: without offload the
800-GPU layout does not fit 32 GB (exit 3), with it it does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_stand_ins import stand_in_overrides

from megazoo.recipes.planner import cli as plan_cli
from megazoo.recipes.config import load_recipe
from megazoo.recipes.planner.fit import device_memory, recipe_layout
from megazoo.recipes.gpus import GPUS
from megazoo.recipes.resolve import resolve

FOLDER = Path(__file__).resolve().parents[2] / "recipes"

# file: (preset, dp, tp, pp, zero stage, global batch, seq, target GPU, GPUs in the header)
ZOO = {
    "gpt2-117m.toml": ("gpt2-117m", 16, 1, 1, 0, 512, 1024, "v100-32gb", 16),
    "gpt2-345m.toml": ("gpt2-345m", 16, 1, 1, 0, 512, 1024, "v100-32gb", 16),
    "gpt2-774m.toml": ("gpt2-774m", 16, 1, 1, 1, 512, 1024, "v100-32gb", 16),
    "gpt2-1.5b.toml": ("gpt2-1.5b", 16, 1, 1, 1, 512, 1024, "v100-32gb", 16),
    "megatron-8.3b.toml": ("megatron-8.3b", 64, 8, 1, 0, 512, 1024, "v100-32gb", 512),
    "tnlg-17b.toml": ("tnlg-17b", 64, 4, 1, 1, 512, 1024, "v100-32gb", 256),
    "gpt-100b.toml": ("gpt-100b", 25, 16, 1, 2, 400, 1024, "v100-32gb", 400),
    "gpt3-175b.toml": ("gpt3-175b", 12, 8, 16, 1, 1536, 2048, "a100-80gb", 1536),
    "gpt-1t.toml": ("gpt-1t", 2, 16, 25, 1, 3072, 1024, "v100-32gb", 800),
}


def _resolved(name: str, tmp_path: Path, extra: tuple[str, ...] = ()):
    path, scratch = FOLDER / name, tmp_path / name  # one stand-in corpus per recipe
    scratch.mkdir(exist_ok=True)
    recipe = load_recipe(path, stand_in_overrides(path, scratch) + list(extra))
    par = recipe.parallel
    return resolve(recipe, world_size=par.dp * par.tp * par.pp)


def test_every_zoo_recipe_is_listed():
    zoo = {p.name for p in FOLDER.glob("*.toml")} - {"demo.toml", "demo_tp2.toml", "finetune.toml",
                                                      "long-context.toml",  # tests/parallel/context/test_context_model.py
                                                      "llama-demo.toml",  # tests/recipes/training/test_llama_demo.py
                                                      "moe-demo.toml",  # tests/recipes/training/test_moe_demo.py
                                                      "deepseek-demo.toml",  # tests/recipes/training/test_deepseek_demo.py
                                                      "sft-demo.toml",  # tests/recipes/training/test_sft_demo.py
                                                      "llama-8b-lora.toml", "llama-8b-full-ft.toml",  # test_lora_planner
                                                      "llama3.1-405b.toml", "llama3.1-405b-128k.toml",
                                                      "llama-70b-full-ft.toml", "llama-405b-full-ft.toml",  # test_llama_recipes.py
                                                      "qwen3-30b-a3b-full-ft.toml", "qwen3-30b-a3b-lora.toml",
                                                      "mixtral-8x7b-ft.toml", "qwen3-235b-a22b.toml", "mixtral-8x22b.toml",  # test_moe_recipes
                                                      "deepseek-v3.toml", "kimi-k2.toml"}  # test_deepseek_recipes
    assert zoo == set(ZOO)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_recipe_is_the_published_setup_and_fits(name, tmp_path):
    preset, dp, tp, pp, zero, batch, seq, gpu, gpus = ZOO[name]
    res = _resolved(name, tmp_path)
    r = res.recipe
    assert (r.model.preset, r.parallel.dp, r.parallel.tp, r.parallel.pp, r.zero.stage) == (preset, dp, tp, pp, zero)
    assert res.global_batch == batch == r.train.global_batch and r.train.seq_len == seq
    assert res.world_size == gpus and f"{gpus:,}" in (FOLDER / name).read_text().split("[model]")[0]
    assert r.train.precision == "fp16" and r.data.source == "indexed"
    mem = device_memory(res.model, recipe_layout(res), GPUS[gpu].memory_gb)
    assert mem.fits, "\n".join(mem.lines())
    header = (FOLDER / name).read_text().split("[model]")[0]
    assert "Source" in header and "Target cluster" in header and gpu.split("-")[0].upper() in header.upper()


@pytest.mark.parametrize("name", ["tnlg-17b.toml", "megatron-8.3b.toml", "gpt2-1.5b.toml"])
def test_plan_cli_says_fits_yes_and_exits_0(name, capsys):
    code = plan_cli.main(["--recipe", str(FOLDER / name), "--gpu-memory", "32"])
    out = capsys.readouterr().out
    assert code == 0 and "fits: yes" in out
    for part in ("model states:", "activations:", "buffers:", "total:", "capacity 32.00 GB"):
        assert part in out


def test_published_hyper_parameters(tmp_path):
    mega = _resolved("megatron-8.3b.toml", tmp_path).recipe.train
    assert (mega.lr, mega.min_lr, mega.warmup_steps, mega.weight_decay, mega.steps) == (1.5e-4, 1e-5, 3000, 0.01,
                                                                                         300_000)
    gpt3 = _resolved("gpt3-175b.toml", tmp_path).recipe.train
    assert (gpt3.lr, gpt3.beta2, gpt3.weight_decay, gpt3.min_lr) == (0.6e-4, 0.95, 0.1, 0.6e-5)
    assert 3.1e6 < 1536 * gpt3.seq_len < 3.3e6  # the paper's 3.2M-token batch


def test_tnlg_needs_zero_at_tp4_and_tp16_without(tmp_path):
    """T-NLG: 17B at tp 4 fits 32 GB only with ZeRO-1; without ZeRO the blog's tp 16 (1,024 GPUs) was needed."""
    res = _resolved("tnlg-17b.toml", tmp_path)
    lay = recipe_layout(res)
    from dataclasses import replace
    assert device_memory(res.model, lay, 32).fits
    assert not device_memory(res.model, replace(lay, zero=0), 32).fits
    # 28 heads: tp 16 divides none of them evenly; 14, the nearest valid degree, fits without ZeRO
    assert device_memory(res.model, replace(lay, zero=0, tp=14), 32).fits


def test_trillion_on_800_gpus_needs_offload(tmp_path, capsys):
    path = str(FOLDER / "gpt-1t.toml")
    assert plan_cli.main(["--recipe", path, "--gpu", "v100-32gb"]) == 0
    assert "fits: yes" in capsys.readouterr().out
    assert plan_cli.main(["--recipe", path, "--gpu", "v100-32gb", "--set", "zero.offload=none"]) == 3
    out = capsys.readouterr().out
    assert "fits: no" in out and "over by" in out
    # without offload: pp = 43 (1,376 GPUs) fits; pp = 32 (1,024 GPUs) only by the ZeRO paper's bytes (megazoo's
    # ZeRO-1 also holds the owned shard's fp32 gradient, 4/N bytes per parameter)
    for pp, paper, want in (("43", [], 0), ("32", [], 3), ("32", ["--paper"], 0)):
        code = plan_cli.main(["--recipe", path, "--gpu", "v100-32gb", "--set", "zero.offload=none",
                              "--set", f"parallel.pp={pp}", "--set", "train.global_batch=3072", *paper])
        assert code == want, capsys.readouterr().out
