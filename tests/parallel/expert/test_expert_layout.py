"""parallel.ep is checked before any process starts: each refusal names the field, the value and what is valid."""

from __future__ import annotations

import pytest
from recipe_helpers import tiny_resolved

from megazoo.parallel.expert.layout import check_expert_parallel
from megazoo.recipes.config import RecipeError


def test_valid_layouts_pass():
    check_expert_parallel(1, 1, 1, 0, 0)  # dense, no ep
    check_expert_parallel(2, 4, 1, 8, 2)  # dp 4 = ep 2 x edp 2
    check_expert_parallel(4, 2, 2, 8, 2)  # ep over dp x cp


@pytest.mark.parametrize("args, kwargs, message", [
    ((0, 2, 1, 8, 2), {}, r"parallel.ep = 0 is invalid: it must be a positive integer"),
    ((2, 2, 1, 0, 0), {"model": "gpt2-tiny"},
     r"parallel.ep = 2 needs a mixture-of-experts model, but gpt2-tiny is dense \(model.n_experts = 0\); "
     r"valid: parallel.ep = 1"),
    ((3, 6, 1, 8, 2), {}, r"parallel.ep = 3 does not divide the 8 routed experts of the model \(model.n_experts\); "
                          r"valid: \[1, 2\]"),
    ((4, 2, 1, 8, 2), {}, r"parallel.ep = 4 does not divide parallel.dp x parallel.cp = 2 x 1 = 2 \(expert "
                          r"parallelism is carved out of them\); valid: \[1, 2\]"),
    ((1, 1, 1, 4, 5), {}, r"model.moe_top_k = 5 is larger than model.n_experts = 4; valid: 1..4"),
    ((2, 2, 1, 4, 2), {"shard_group": "node"}, r"zero.shard_group = 'node' with parallel.ep = 2 is not supported"),
    ((2, 2, 1, 4, 2), {"hpz": True}, r"zero.hpz = True with parallel.ep = 2 is not supported"),
    ((2, 2, 1, 4, 2), {"quantized_gradients": "int8"}, r"zero.quantized_gradients = 'int8' with parallel.ep = 2"),
    ((2, 2, 1, 4, 2), {"optimizer": "onebit_adam"}, r"optimizer.name = 'onebit_adam' with parallel.ep = 2"),
    ((2, 2, 1, 4, 2), {"lora": True, "zero_stage": 3}, r"lora \(frozen experts\) with parallel.ep = 2 and "
                                                        r"zero.stage = 3 is not supported.*valid: zero.stage 0, 1 or 2"),
])
def test_refusals_name_field_value_and_valid(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_expert_parallel(*args, **kwargs)


def test_resolver_refuses_before_any_process():
    with pytest.raises(RecipeError, match=r"parallel.ep = 2 needs a mixture-of-experts model, but gpt2-tiny is dense"):
        tiny_resolved(parallel={"dp": 2, "ep": 2})
    with pytest.raises(RecipeError, match=r"parallel.ep = 0 is invalid"):
        tiny_resolved(parallel={"ep": 0})
    with pytest.raises(RecipeError, match=r"unknown key|epp"):
        tiny_resolved(parallel={"epp": 2})
    moe = {"preset": "llama-tiny", "n_layer": 2, "d_model": 32, "d_ff": 48, "vocab_size": 300, "n_experts": 4,
           "moe_top_k": 2, "moe_d_ff": 16}
    with pytest.raises(RecipeError, match=r"parallel.ep = 3 does not divide the 4 routed experts of llama-tiny "
                                          r"\(model.n_experts\); valid: \[1\]"):
        tiny_resolved(model=moe, parallel={"dp": 3, "ep": 3}, train={"micro_batch": 1})
    with pytest.raises(RecipeError, match=r"parallel.ep = 4 does not divide parallel.dp x parallel.cp = 2 x 1"):
        tiny_resolved(model=moe, parallel={"dp": 2, "ep": 4})
    with pytest.raises(RecipeError, match=r"lora \(frozen experts\) with parallel.ep = 2 and zero.stage = 3"):
        tiny_resolved(model=moe, parallel={"dp": 2, "ep": 2}, zero={"stage": 3}, lora={"rank": 4})
    assert tiny_resolved(model=moe, parallel={"dp": 2, "ep": 2}).recipe.parallel.ep == 2
