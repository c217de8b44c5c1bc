"""`megazoo verify` on MoE models: the demo recipe (dp 2, ZeRO) with a Qwen3-MoE, Qwen2-MoE (gated shared expert)
or Mixtral preset shrinks to 4 small experts (top-2, the preset's width ratios, heads of the shrink's width) and
passes against one process in fp64 at 1e-10, aux loss included: the expert counts of the aux loss are the whole
batch's over dp, so the data-parallel layout computes one process's function."""

from __future__ import annotations

import pytest

from megazoo.recipes import cli
from megazoo.recipes.config import load_recipe
from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.verify.shrink import plan


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen2-57b-a14b", "mixtral-8x7b"])
def test_moe_presets_verify_at_the_demo_layout(preset, capsys):
    assert cli.main(["verify", "demo", "--set", f"model.preset={preset}", "--steps", "2"]) == 0, \
        capsys.readouterr().out


def test_the_shrunk_moe_model():
    recipe = load_recipe(find_recipe("demo"), ["model.preset=qwen3-235b-a22b"])
    model = plan(recipe, steps=2).layout.model
    assert (model.n_experts, model.moe_top_k, model.head_dim, model.qk_norm) == (4, 2, 8, True)
    assert model.moe_d_ff == 2 * round(model.d_model * 1536 / 4096 / 2)
