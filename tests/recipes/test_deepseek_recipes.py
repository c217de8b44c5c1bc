"""The DeepSeek-V3 / Kimi K2 recipes at their reports' layouts: recipes/deepseek-v3.toml is the DeepSeek-V3
report's (2,048 H800: pp 16 x ep 64 over 8 nodes x ZeRO-1 dp 128, no tp) and fits 80 GB; recipes/kimi-k2.toml is
the Kimi K2 report's parallelism (pp 16 x ep 16 x ZeRO-1) on its smallest cluster, 256 GPUs, which fits an H200's
141 GB and not an H100's 80 GB; `megazoo plan --recipe` prints the report's figures beside its own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from megazoo.recipes.catalog import stated_gpu
from megazoo.recipes.dry_run.run import load
from megazoo.recipes.planner import cli as plan_cli
from megazoo.recipes.planner.fit import device_memory, recipe_layout

FOLDER = Path(__file__).resolve().parents[2] / "recipes"

# (preset, world, pp, ep, dp, tp, zero, global batch, seq, target GPU)
REPORTS = {"deepseek-v3.toml": ("deepseek-v3", 2048, 16, 64, 128, 1, 1, 15360, 4096, "h800-80gb"),
           "kimi-k2.toml": ("kimi-k2", 256, 16, 16, 16, 1, 1, 16384, 4096, "h200-141gb")}


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_the_reports_layout_with_experts_on_every_stage(name):
    preset, world, pp, ep, dp, tp, zero, batch, seq, gpu = REPORTS[name]
    res = load(FOLDER / name)
    par, t = res.recipe.parallel, res.recipe.train
    assert (res.model.name, res.world_size, par.pp, par.ep, par.dp, par.tp, res.recipe.zero.stage) == (
        preset, world, pp, ep, dp, tp, zero)
    assert (res.global_batch, t.seq_len, stated_gpu(FOLDER / name)) == (batch, seq, gpu)
    assert res.model.n_experts % ep == 0 and ep <= dp
    # every stage holds MoE blocks: a stage of dense blocks only would hold no experts to split over ep
    assert [list(s) for s in res.stage_layers] == [list(layers) for layers in par.layers]
    assert all(any(res.model.moe_layer(i) for i in stage) for stage in res.stage_layers)
    assert sorted(i for stage in res.stage_layers for i in stage) == list(range(res.model.n_layer))


def test_deepseek_v3_plans_on_h800_beside_the_reports_figures(capsys):
    assert plan_cli.main(["--recipe", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Memory plan: deepseek-v3 on h800-80gb") and "fits: yes" in out
    assert "(experts over ep=64) = 2048 GPUs, ZeRO-1" in out
    for needle in ("DeepSeek-V3 Technical Report (arXiv:2412.19437)'s own figures", "2,048 H800 | 2,048",
                   "16 x 64 x 1, ZeRO-1 | 16 x 64 x 1, ZeRO-1", "671B + 14B MTP / 37B | 671B + 11.61B MTP / 37.55B",
                   "(671,026,404,352 main + 11,610,067,968 in 1 MTP module(s))", "11.61B + 1.853B = 13.46B here",
                   "(1.070e+10 of them in multi-token prediction, depth 1)",
                   "62.91M | 62.91M", "14.8T | 14.78T", "2.664M | ", "2.788M H800 GPU hours in all"):
        assert needle in out, needle


def test_kimi_k2_fits_an_h200_and_not_an_h100(capsys):
    res = load(FOLDER / "kimi-k2.toml")
    layout = recipe_layout(res)
    h200, h100 = device_memory(res.model, layout, 141), device_memory(res.model, layout, 80)
    assert h200.fits and not h100.fits
    # without activation checkpointing not even the H200: 15 micro-batches x 4 blocks of full activations
    assert not device_memory(res.model, replace(layout, checkpointing=False), 141).fits
    assert plan_cli.main(["--recipe", "kimi-k2"]) == 0
    out = capsys.readouterr().out
    assert "on h200-141gb" in out and "fits: yes" in out and "Kimi K2 report (arXiv:2507.20534)" in out
    assert "16 x 16 x 1, ZeRO-1 | 16 x 16 x 1, ZeRO-1" in out and "15.5T | 15.5T" in out
    assert plan_cli.main(["--recipe", "kimi-k2", "--gpu", "h100-80gb"]) == 3
