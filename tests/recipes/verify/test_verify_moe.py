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


def test_accumulating_moe_recipes_leave_out_only_the_pooled_aux_loss():
    """At grad_accum > 1 with dp > 1 the load-balancing loss pools micro-batches no one process holds together:
    verify sets its coefficient to 0 on both sides and says so; at grad_accum 1 (moe-demo) it stays compared.
    LoRA's dropout is 0 on both sides, as the model's."""
    accum = plan(load_recipe(find_recipe("qwen3-30b-a3b-lora")), steps=2)
    assert accum.layout.recipe.train.grad_accum == 2 and accum.layout.recipe.parallel.dp == 2
    assert accum.layout.model.moe_aux_loss_coef == accum.reference.model.moe_aux_loss_coef == 0.0
    assert any(line.startswith("model.moe_aux_loss_coef = 0.001 (set to 0 on both sides)")
               for line in accum.not_compared)
    assert accum.layout.recipe.lora.dropout == accum.reference.recipe.lora.dropout == 0.0
    demo = plan(load_recipe(find_recipe("moe-demo")), steps=2)
    assert demo.layout.model.moe_aux_loss_coef == demo.reference.model.moe_aux_loss_coef == 0.01
    assert not any("moe_aux_loss_coef" in line for line in demo.not_compared)
