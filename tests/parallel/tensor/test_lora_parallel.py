"""LoRA training computes the same function in every layout: the real Trainer with `[lora]` on, 3 steps in fp64,
against the single-process reference (losses, grad norms, every full parameter to 1e-10), at ZeRO-3 (frozen base
weights partitioned and gathered, no optimizer state for them), tp 2 with ZeRO-2 and activation checkpointing,
pp 2 with ZeRO-1, and context parallel cp 2. The base weights never move; only adapters hold optimizer state."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_recipe

from megazoo.models.lora.adapters import adapter_parameters
from megazoo.parallel.tensor.lora import is_lora_parameter
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

LORA = {"rank": 4, "alpha": 8.0, "targets": ["qkv", "o", "up", "down"]}
BASE = {"train": {"steps": 3, "warmup_steps": 1, "lr": 1e-2}, "lora": LORA}


def _resolved(parallel=None, train=None, zero=None):
    return resolve(tiny_recipe(**{**BASE, "parallel": parallel or {}, "train": {**BASE["train"], **(train or {})},
                                  "zero": zero or {}}))


def _train(res, topo):
    trainer = Trainer(res, topo)
    trainable = {n for c in trainer.chunks for n, p in c.named_parameters() if p.requires_grad}
    before = trainer.full_state_dict()
    result = trainer.fit()
    return {"losses": result.losses, "norms": result.grad_norms, "before": before,
            "params": trainer.full_state_dict(), "trainable": trainable,
            "local_adapters": sum(p.numel() for c in trainer.chunks for p in c.parameters() if p.requires_grad),
            "optimizer_elements": sum(t.numel() for s in trainer.optimizer.state.values() for t in s.values()
                                      if torch.is_tensor(t) and t.dim())}


@pytest.fixture(scope="module")
def reference():
    return _train(_resolved(train={"micro_batch": 4}), Topology.solo())


def test_only_adapters_train(reference):
    assert reference["trainable"] and all(is_lora_parameter(n) for n in reference["trainable"])
    for name, value in reference["params"].items():
        moved = not torch.equal(value, reference["before"][name])
        assert moved == is_lora_parameter(name), name
    adapters = sum(v.numel() for n, v in reference["params"].items() if is_lora_parameter(n))
    assert reference["optimizer_elements"] == 2 * adapters  # Adam's two moments, of the adapters only


LAYOUTS = {
    "dp2-zero3": ({"dp": 2}, {"micro_batch": 2}, {"stage": 3}),
    "dp2-zero3-checkpointing": ({"dp": 2}, {"micro_batch": 1, "grad_accum": 2, "activation_checkpointing": True},
                                {"stage": 3}),
    "tp2-zero2-checkpointing": ({"tp": 2}, {"micro_batch": 4, "activation_checkpointing": True}, {"stage": 2}),
    # sequence parallelism: column adapters read the gathered x, row adapters join the reduce-scatter
    "tp2-sequence-parallel": ({"tp": 2, "sequence_parallel": True}, {"micro_batch": 4}, {}),
    "pp2-zero1": ({"pp": 2}, {"micro_batch": 2, "grad_accum": 2}, {"stage": 1}),
    "cp2": ({"cp": 2}, {"micro_batch": 4}, {}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_reference(reference, layout):
    parallel, train, zero = LAYOUTS[layout]
    res = _resolved(parallel, train, zero)
    par = res.recipe.parallel
    results = run_distributed(lambda: _train(res, Topology.of(par)),
                              res.world_size)
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-10, atol=0)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(reference["norms"]), rtol=1e-10, atol=0)
        assert got["params"].keys() == reference["params"].keys()
        for name, value in reference["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-10, msg=name)
        if layout.startswith("tp2"):  # the planner's count of one tp rank's adapters (A or B split, not both)
            assert got["local_adapters"] == adapter_parameters(res.model, res.recipe.lora, tp=2) * res.model.n_layer


def test_bad_lora_section_is_refused_before_any_process():
    with pytest.raises(RecipeError, match="lora.targets"):
        resolve(tiny_recipe(lora={"rank": 4, "targets": ["gate"]}))  # GPT-2's MLP has no gate
    with pytest.raises(RecipeError, match="lora.rank"):
        resolve(tiny_recipe(lora={"rank": -1}))
    with pytest.raises(RecipeError, match="unknown recipe key.*lora.ranks"):
        tiny_recipe(lora={"ranks": 4})
