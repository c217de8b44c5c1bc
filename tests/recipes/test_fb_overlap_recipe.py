"""parallel.fb_overlap (DualPipe-V's forward/backward overlap under ep) is refused, naming field, value and what is
valid, with another schedule, without ep, and - until the trainer runs the overlap engine - at all."""

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
    ({"fb_overlap": True, "pp": 2, "dp": 2, "ep": 2, "schedule": "dualpipev"}, "the trainer does not run the overlap engine yet"),
])
def test_fb_overlap_is_refused_with_its_reason(parallel, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(tiny_recipe(model=MOE, parallel=parallel, train={"grad_accum": 4}))


def test_fb_overlap_defaults_off_and_unknown_keys_stay_refused():
    assert tiny_recipe().parallel.fb_overlap is False
    table = {**TINY, "parallel": {**TINY["parallel"], "fb_overlaps": True}}
    with pytest.raises(Exception, match="fb_overlaps"):
        from_dict(Recipe, table)
