"""The mixture-of-experts recipes at their stated setups: Qwen3-30B-A3B full fine-tuning and LoRA on one node of 8,
Mixtral 8x7B fine-tuning on two nodes, Qwen3-235B-A22B pretraining at Megatron-Bridge's recommended layout. Each
resolves at its real size (stand-in corpus, tokenizer and HF folder), is the layout its header states, and
`megazoo plan --recipe` says it fits 80 GB; the layouts' reasons hold (without expert parallelism, or on fewer
nodes, they do not fit). Their full-size dry runs: tests/recipes/planner/test_moe_dry_run.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from recipe_stand_ins import stand_in_overrides

from megazoo.models.presets import get_preset
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.planner import cli as plan_cli
from megazoo.recipes.planner.fit import device_memory, recipe_layout
from megazoo.recipes.resolve import resolve

FOLDER = Path(__file__).resolve().parents[2] / "recipes"

# file: (preset, dp, tp, pp, cp, ep, zero stage, LoRA targets, GPUs)
MOE = {
    "qwen3-30b-a3b-full-ft.toml": ("qwen3-30b-a3b", 8, 1, 1, 1, 8, 3, (), 8),
    "qwen3-30b-a3b-lora.toml": ("qwen3-30b-a3b", 8, 1, 1, 1, 8, 1, ("q", "k", "v", "o"), 8),
    "mixtral-8x7b-ft.toml": ("mixtral-8x7b", 16, 1, 1, 1, 8, 3, (), 16),
    "qwen3-235b-a22b.toml": ("qwen3-235b-a22b", 8, 4, 16, 2, 8, 1, (), 1024),
    "mixtral-8x22b.toml": ("mixtral-8x22b", 8, 2, 8, 1, 8, 1, (), 128),
}


def _resolved(name: str, tmp_path: Path, extra: tuple[str, ...] = ()):
    path = FOLDER / name
    tmp_path.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(path, stand_in_overrides(path, tmp_path) + list(extra))
    par = recipe.parallel
    return resolve(recipe, world_size=par.dp * par.tp * par.pp * par.cp)


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_recipe_is_its_stated_layout_and_fits_80gb(name, tmp_path, capsys):
    preset, dp, tp, pp, cp, ep, zero, targets, gpus = MOE[name]
    res = _resolved(name, tmp_path)
    r = res.recipe
    assert (r.model.preset, r.parallel.dp, r.parallel.tp, r.parallel.pp, r.parallel.cp, r.parallel.ep,
            r.zero.stage) == (preset, dp, tp, pp, cp, ep, zero)
    assert res.model.n_experts and res.world_size == gpus and r.train.precision == "bf16"
    assert tuple(r.lora.targets) == targets if targets else not r.lora.enabled
    assert device_memory(res.model, recipe_layout(res), 80).fits
    # the command a user runs, on the GPU the header names (stated_gpu), with no flag
    assert plan_cli.main(["--recipe", str(FOLDER / name)]) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and f"experts over ep={ep}" in out and "active per token" in out


def test_qwen3_235b_is_megatron_bridges_layout(tmp_path):
    res = _resolved("qwen3-235b-a22b.toml", tmp_path)
    par, t = res.recipe.parallel, res.recipe.train
    assert (par.tp, par.pp, par.cp, par.ep, par.sequence_parallel, t.micro_batch, t.seq_len) == (4, 16, 2, 8, True,
                                                                                              1, 4096)
    # embedding and loss counted as a layer each (account_for_embedding / loss_in_pipeline_split): 96 / 16 = 6
    assert [len(s) for s in res.stage_layers] == [5] + [6] * 14 + [5] and res.model.n_layer == 94
    assert res.model.moe_aux_loss_scope == "layer"  # a pipeline stage's routers' loss of its own
    header = (FOLDER / "qwen3-235b-a22b.toml").read_text().split("[model]")[0]
    assert "TP=4, PP=16, CP=2, EP=8" in header and "arXiv:2505.09388" in header and "H100-80GB" in header


def test_the_layouts_reasons_hold(tmp_path):
    """Qwen3-30B-A3B on one node needs ZeRO-3 at ep 8 (ZeRO-1 keeps its 16 experts' fp32 states whole: over
    80 GB); Mixtral 8x7B needs its two nodes (one node of 8 at the same ep and ZeRO: over 80 GB)."""
    qwen = _resolved("qwen3-30b-a3b-full-ft.toml", tmp_path / "q")
    assert not device_memory(qwen.model, replace(recipe_layout(qwen), zero=1), 80).fits
    mixtral = _resolved("mixtral-8x7b-ft.toml", tmp_path / "m")
    assert not device_memory(mixtral.model, replace(recipe_layout(mixtral), dp=8), 80).fits


def test_lora_on_the_experts_is_refused_before_any_process(tmp_path):
    with pytest.raises(RecipeError) as err:
        _resolved("qwen3-30b-a3b-lora.toml", tmp_path, ('lora.targets=["q", "v", "gate", "up"]',))
    msg = str(err.value)
    assert "lora.targets" in msg and "'gate', 'up'" in msg and "experts" in msg and "valid targets" in msg


def test_mixtral_8x22b_needs_its_eight_stages(tmp_path):
    """The header's reason for pp 8: at pp 4 each GPU keeps 4.2B expert parameters' states (no fit)."""
    res = _resolved("mixtral-8x22b.toml", tmp_path)
    cfg, par = res.model, res.recipe.parallel
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.n_experts, cfg.moe_top_k, cfg.moe_d_ff,
            cfg.rope_theta) == (56, 6144, 48, 8, 8, 2, 16384, 1e6)
    assert get_preset("mixtral-8x22b").vocab_size == 32768  # (the stand-in tokenizer here sets its own)
    assert par.sequence_parallel and res.model.moe_aux_loss_scope == "layer"
    lay = recipe_layout(res)
    assert device_memory(cfg, lay, 80).fits
    assert not device_memory(cfg, replace(lay, pp=4, stage_layers=None), 80).fits
