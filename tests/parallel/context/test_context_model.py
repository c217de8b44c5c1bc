"""Context parallelism in the whole training step: every cp layout trains the single-process reference's function.

The real Trainer runs 10 fp64 steps (clipping and warmup active) with each sequence split over cp = 2 ranks
(load-balanced chunks, positions following them, loss over the whole sequences, gradients averaged over dp x cp),
composed with dp, tp, ZeRO-3 and pp, through both attention algorithms; losses, grad norms, validation loss and
full parameters must equal the reference's (tests/recipes/training/test_train_parity.py) within 1e-10. Bad cp layouts are refused
by resolve() before any process starts.
"""

from __future__ import annotations

import dataclasses

import pytest
import parity_helpers as parity
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve


@pytest.fixture(scope="module")
def reference():
    return parity.train_run(tiny_resolved(train={"micro_batch": 8}), Topology.solo())


def _train_cp(parallel: dict, train: dict, zero: dict | None = None):
    res = tiny_resolved(parallel=parallel, train=train, zero=zero or {})
    par = res.recipe.parallel

    def work():
        topo = Topology.of(par)
        return dict(parity.train_run(res, topo), cp=(topo.cp, topo.cp_rank, topo.cp_attention))

    results = run_distributed(work, res.world_size)
    assert sorted(r["cp"] for r in results) == sorted((2, i % 2, par.cp_attention) for i in range(res.world_size))
    return results


@pytest.mark.parametrize("parallel, train, zero", [
    ({"dp": 2, "cp": 2, "cp_attention": "all_to_all"}, {"micro_batch": 4}, {}),
    ({"tp": 2, "cp": 2, "cp_attention": "ring"}, {"micro_batch": 8}, {}),
    ({"dp": 2, "cp": 2, "cp_attention": "ring"}, {"micro_batch": 4}, {"stage": 3}),
    ({"pp": 2, "cp": 2, "cp_attention": "all_to_all"}, {"micro_batch": 4, "grad_accum": 2}, {}),
    ({"cp": 2, "cp_attention": "ring"}, {"micro_batch": 8, "activation_checkpointing": True}, {}),
], ids=["dp2-ulysses", "tp2-ring", "zero3-dp2-ring", "pp2-ulysses", "ring-recomputed"])
def test_context_parallel_training_equals_reference(reference, parallel, train, zero):
    for got in _train_cp(parallel, train, zero):
        parity.assert_same_training(got, reference)


@pytest.mark.parametrize("parallel, train, model, world, message", [
    ({"cp": 2}, {"seq_len": 30}, {}, None,
     "train.seq_len = 30 is not divisible by 2 x parallel.cp = 4"),
    ({"cp": 4, "tp": 2, "cp_attention": "all_to_all"}, {}, {}, None,
     "needs the local head count (model.n_head / parallel.tp = 2) divisible by parallel.cp = 4"),
    ({"cp": 2, "cp_attention": "ring"}, {}, {"attn_dropout": 0.1}, None,
     "model.attn_dropout = 0.1"),
    ({"cp": 2, "cp_attention": "zigzag"}, {}, {}, None,
     "parallel.cp_attention = 'zigzag' is invalid; valid: all_to_all, ring"),
    ({"cp": 0}, {}, {}, None, "parallel.cp = 0"),
    ({"cp": 2, "dp": 2}, {}, {}, 2, "parallel dp=2 x tp=1 x pp=1 x cp=2 = 4 processes, but 2 were started"),
])
def test_bad_context_layouts_fail_before_start(parallel, train, model, world, message):
    recipe = tiny_recipe(parallel=parallel, train=train, model=model)
    with pytest.raises(RecipeError) as err:
        resolve(recipe, world_size=world)
    assert message in str(err.value)


def test_ring_refuses_indivisible_sequence_but_any_heads():
    res = resolve(tiny_recipe(parallel={"cp": 4, "tp": 2, "cp_attention": "ring"}, train={"seq_len": 32}))
    assert res.world_size == 8  # 2 local heads over 4 cp ranks: fine for the ring


def test_planner_counts_activations_per_cp_rank():
    from megazoo.models.presets import get_preset
    from megazoo.recipes.planner.activations import ActivationSpec, layer_bytes, stage_activations
    from megazoo.recipes.planner.fit import recipe_layout

    cfg = get_preset("gpt2-117m")
    flash = ActivationSpec.for_model(cfg, flash_attention=True)

    def total(seq, cp, spec):
        return stage_activations(cfg, seq, 2, 1, [12], spec=spec, cp=cp)[0].total_bytes

    # Fused attention: everything is per token, so cp ranks of an 8k sequence hold what one rank of 8k / cp does.
    assert total(8192, 4, flash) == total(2048, 1, flash)
    # Stored scores: a / cp heads over the whole sequence (all-to-all), i.e. a x (s / cp) x s per layer.
    plain = ActivationSpec.for_model(cfg)
    s, b, h, a = 4096, 2, cfg.d_model, cfg.n_head
    assert layer_bytes(s // 4, b, h, a, 1, plain, cp=4) - layer_bytes(s // 4, b, h, a, 1, plain) == pytest.approx(
        5 * a * (s // 4) * (s - s // 4) * b)  # 5 bytes per score: probabilities 2, mask 1, dropout output 2
    layout = recipe_layout(resolve(tiny_recipe(parallel={"cp": 2, "dp": 2})))
    assert (layout.cp, layout.gpus) == (2, 4) and "x cp=2 = 4 GPUs" in layout.describe()


def test_long_context_recipe_resolves_and_fits(tmp_path):
    from pathlib import Path

    from recipe_stand_ins import stand_in_overrides

    from megazoo.recipes.config import load_recipe
    from megazoo.recipes.planner.fit import device_memory, recipe_layout
    from megazoo.recipes.gpus import GPUS

    path = Path(__file__).resolve().parents[3] / "recipes" / "long-context.toml"
    res = resolve(load_recipe(path, stand_in_overrides(path, tmp_path)), world_size=8)
    par = res.recipe.parallel
    assert (par.cp, par.cp_attention, res.recipe.train.seq_len, res.model.n_positions) == (8, "ring", 32768, 32768)
    mem = device_memory(res.model, recipe_layout(res), GPUS["v100-32gb"].memory_gb)
    assert mem.fits, "\n".join(mem.lines())
    # cp = 8: 1/8 of the sequence's activations. The fused cross-entropy's chunk in flight is a fixed workspace
    # (at most CE_CHUNK_ELEMENTS rows of the vocabulary shard), not per token: compared without it, and without the
    # fused head + loss that train.fused_loss = "auto" takes here (its kept dW is the head's size, not per token)
    assert res.fused_loss
    per_token = dataclasses.replace(recipe_layout(res), fused_ce=False, fused_loss=False)
    eighth = device_memory(res.model, per_token, GPUS["v100-32gb"].memory_gb)
    one_rank = device_memory(res.model, dataclasses.replace(per_token, cp=1), GPUS["v100-32gb"].memory_gb)
    assert eighth.activations * 8 == pytest.approx(one_rank.activations)
