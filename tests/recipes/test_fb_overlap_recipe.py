"""parallel.fb_overlap (DualPipe-V's forward/backward overlap under ep) is refused, naming field, value and what is
valid, with another schedule, without ep, and where the sub-staged decoder chunks do not cover the run (activation
checkpointing, the fused loss, a capacity factor, dropout, sequence parallelism, ...); accepted
otherwise."""

from __future__ import annotations

import pytest

from megazoo.recipes.config import Recipe, RecipeError, from_dict
from megazoo.recipes.resolve import resolve

from recipe_helpers import TINY, tiny_recipe

MOE = {"preset": "llama-tiny", "n_layer": 4, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
       "vocab_size": 300, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": 16}


@pytest.mark.parametrize("parallel, message", [
    ({"fb_overlap": "yes"}, "parallel.fb_overlap = 'yes' has the wrong type: expected bool"),
    ({"fb_overlap": True, "pp": 2, "schedule": "zbv"}, "needs parallel.schedule = 'dualpipev' (got 'zbv')"),
    ({"fb_overlap": True, "pp": 2, "schedule": "dualpipev"}, "needs parallel.ep >= 2 (got ep = 1)"),
    ({"fb_overlap": True, "pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev"},
     "train.fused_loss = 'auto' is not covered by the sub-staged decoder chunks"),
])
def test_fb_overlap_is_refused_with_its_reason(parallel, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(tiny_recipe(model=MOE, parallel=parallel, train={"grad_accum": 4}))


COVERED = {"precision": "fp64", "fused_loss": "off", "grad_accum": 4}
OVERLAP = {"fb_overlap": True, "pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev"}


@pytest.mark.parametrize("model, train, parallel, message", [
    ({}, {"activation_checkpointing": True}, {}, "train.activation_checkpointing = True"),
    ({"moe_capacity_factor": 1.5}, {}, {}, "model.moe_capacity_factor = 1.5"),
    ({"dropout": 0.1}, {}, {}, "model.dropout = 0.1"),
    ({"moe_aux_loss_coef": 0.01}, {}, {}, "model.moe_aux_loss_scope = 'model'"),
    ({}, {}, {"tp": 2, "sequence_parallel": True}, "parallel.sequence_parallel = True"),
])
def test_fb_overlap_refuses_what_the_sub_stages_do_not_cover(model, train, parallel, message):
    with pytest.raises(RecipeError, match=f"{message}.*valid: "):
        resolve(tiny_recipe(model={**MOE, "dropout": 0.0, "attn_dropout": 0.0, **model},
                            parallel={**OVERLAP, **parallel}, train={**COVERED, **train}))


@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16", "fp16"])
def test_fb_overlap_is_accepted_where_the_sub_stages_cover_it(precision):
    """Autocast included: each compute sub-stage runs under it (tests/recipes/test_fb_overlap_decoder.py)."""
    res = resolve(tiny_recipe(model={**MOE, "dropout": 0.0, "attn_dropout": 0.0, "moe_aux_loss_scope": "layer",
                                     "moe_aux_loss_coef": 0.01}, parallel=OVERLAP,
                              train={**COVERED, "precision": precision}))
    assert res.recipe.parallel.fb_overlap


def test_fb_overlap_defaults_off_and_unknown_keys_stay_refused():
    assert tiny_recipe().parallel.fb_overlap is False
    table = {**TINY, "parallel": {**TINY["parallel"], "fb_overlaps": True}}
    with pytest.raises(Exception, match="fb_overlaps"):
        from_dict(Recipe, table)
