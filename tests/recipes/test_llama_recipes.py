"""The Llama recipes at published setups: Llama 3.1 405B at the Llama 3 paper's layouts (recipes/llama3.1-405b.toml,
8K context; recipes/llama3.1-405b-128k.toml, 128K with cp = 16) and 70B full fine-tuning with tp 8 x ZeRO-1 on 64
GPUs (recipes/llama-70b-full-ft.toml): each is the stated layout and `megazoo plan --recipe` says it fits 80 GB.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from megazoo.recipes.planner import cli as plan_cli
from megazoo.recipes.dry_run.run import load
from megazoo.recipes.planner.fit import device_memory, recipe_layout

FOLDER = Path(__file__).resolve().parents[2] / "recipes"

# Dubey et al. 2024, "The Llama 3 Herd of Models", table 4: (tp, cp, pp, dp, sequence length, batch size / dp)
PAPER = {"llama3.1-405b.toml": (8, 1, 16, 128, 8192, 16), "llama3.1-405b-128k.toml": (8, 16, 16, 8, 131072, 16)}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_405b_is_the_papers_layout_and_fits_80gb(name, capsys):
    res = load(FOLDER / name)
    par, t = res.recipe.parallel, res.recipe.train
    tp, cp, pp, dp, seq, per_dp = PAPER[name]
    assert (par.tp, par.cp, par.pp, par.dp, t.seq_len, t.micro_batch * t.grad_accum) == (tp, cp, pp, dp, seq, per_dp)
    assert res.world_size == 16_384 and par.sequence_parallel and res.model.name == "llama3.1-405b"
    assert 16e6 < res.global_batch * t.seq_len < 17e6  # the paper's 16M tokens per batch
    # the paper's balance: one Transformer layer fewer on the first and the last stage
    assert [len(s) for s in res.stage_layers] == [7] + [8] * 14 + [7]
    header = (FOLDER / name).read_text().split("[model]")[0]
    assert "Dubey et al. 2024" in header and "table 4" in header and "H100-80GB" in header
    assert device_memory(res.model, recipe_layout(res), 80).fits
    assert plan_cli.main(["--recipe", str(FOLDER / name), "--gpu", "h100-80gb"]) == 0
    assert "fits: yes" in capsys.readouterr().out


def test_70b_full_ft_is_tp8_zero1_on_64_and_fits_80gb(capsys):
    res = load(FOLDER / "llama-70b-full-ft.toml")
    par = res.recipe.parallel
    assert (par.tp, par.dp, par.pp, res.recipe.zero.stage, res.world_size) == (8, 8, 1, 1, 64)
    assert res.model.name == "llama3.1-70b"
    toml = tomllib.loads((FOLDER / "llama-70b-full-ft.toml").read_text())  # planning: the preset stands in for it
    assert toml["model"]["from_hf"] == "models/Llama-3.1-70B"  # a downloaded HF folder, each rank reading its slices
    assert plan_cli.main(["--recipe", str(FOLDER / "llama-70b-full-ft.toml"), "--gpu-memory", "80"]) == 0
    assert "fits: yes" in capsys.readouterr().out
    # and not without ZeRO-1: 70.6B / 8 x 16 bytes of model states per rank alone exceed 80 GB
    from dataclasses import replace
    assert not device_memory(res.model, replace(recipe_layout(res), zero=0), 80).fits


def test_405b_full_ft_reads_hf_straight_into_tp8_pp16_and_fits_80gb(capsys):
    """The 405B fine-tune starts from the downloaded HF folder (each rank its tp x pp slices, no conversion) and
    the plan states the host memory a rank needs while loading it."""
    res = load(FOLDER / "llama-405b-full-ft.toml")
    par = res.recipe.parallel
    assert (par.tp, par.pp, par.dp, res.recipe.zero.stage, res.world_size) == (8, 16, 2, 1, 256)
    assert res.model.name == "llama3.1-405b" and par.sequence_parallel
    toml = tomllib.loads((FOLDER / "llama-405b-full-ft.toml").read_text())
    assert toml["model"]["from_hf"] == "models/Llama-3.1-405B"
    assert plan_cli.main(["--recipe", str(FOLDER / "llama-405b-full-ft.toml"), "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "loading model.from_hf: host memory per rank" in out
    # ZeRO-1 over the 2 replicas: each rank its stage's bf16 weights whole, half of the fp32 masters and moments
    states = device_memory(res.model, recipe_layout(res), 80).states
    assert states.params_bytes == 2 * states.psi and states.optimizer_bytes == 12 * states.psi / 2
