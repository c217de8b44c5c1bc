"""The planner counts a LoRA run's model states as its optimizers hold them: the frozen base stored (partitioned
at ZeRO-3) with no gradient or optimizer state, the adapters with all of theirs; and `megazoo plan`'s fit sees
the difference."""

from __future__ import annotations

import pytest
from recipe_helpers import tiny_recipe

from megazoo.models.lora.adapters import adapter_parameters
from megazoo.parallel.topology import Topology
from megazoo.recipes.planner.fit import device_memory, recipe_layout
from megazoo.recipes.planner.lora import lora_state_memory
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

LORA = {"rank": 4, "alpha": 8.0, "targets": ["qkv", "o", "up", "down"]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_planner_equals_measured_lora_states(stage):
    res = resolve(tiny_recipe(train={"steps": 1}, zero={"stage": stage}, lora=LORA))
    trainer = Trainer(res, Topology.solo())
    trainer.fit()
    params = [p for c in trainer.chunks for p in c.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    assert trainable == adapter_parameters(res.model, res.recipe.lora, tp=1) * res.model.n_layer
    measured = trainer.zero.memory_bytes()
    planned = lora_state_memory(frozen, trainable, 1, stage, "fp64")
    assert measured["params"] == planned.params_bytes
    assert measured["grads"] == planned.grads_bytes
    assert measured["optimizer"] == planned.optimizer_bytes


def test_fit_counts_only_adapter_states():
    full = resolve(tiny_recipe(zero={"stage": 1}))
    lora = resolve(tiny_recipe(zero={"stage": 1}, lora=LORA))
    full_mem = device_memory(full.model, recipe_layout(full), 80)
    lora_mem = device_memory(lora.model, recipe_layout(lora), 80)
    assert lora_mem.states.optimizer_bytes < full_mem.states.optimizer_bytes / 10
    assert lora_mem.states.params_bytes > full_mem.states.params_bytes  # the base plus the adapters
    assert lora_mem.model_states < full_mem.model_states


def test_llama_8b_recipes_fit_where_they_say():
    """recipes/llama-8b-lora.toml fits one 24 GB GPU (and would not without LoRA); recipes/llama-8b-full-ft.toml
    fits 8 x 80 GB with ZeRO-3."""
    from pathlib import Path

    from megazoo.recipes.config import load_recipe
    from megazoo.recipes.resolve import resolve_for_planning

    recipes = Path(__file__).resolve().parents[3] / "recipes"
    lora = resolve_for_planning(load_recipe(recipes / "llama-8b-lora.toml"))
    assert lora.recipe.lora.rank == 16 and lora.model.name == "llama3.1-8b"
    assert device_memory(lora.model, recipe_layout(lora), 24).fits
    no_lora = resolve_for_planning(load_recipe(recipes / "llama-8b-lora.toml", ["lora.rank=0"]))
    assert not device_memory(no_lora.model, recipe_layout(no_lora), 24).fits
    full = resolve_for_planning(load_recipe(recipes / "llama-8b-full-ft.toml"))
    assert full.world_size == 8 and full.recipe.zero.stage == 3
    assert device_memory(full.model, recipe_layout(full), 80).fits
