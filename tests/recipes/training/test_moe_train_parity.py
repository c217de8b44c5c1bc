"""An MoE decoder trains the same function in every tensor-parallel layout: the real Trainer, 10 fp64 steps with
warmup and clipping, the training loss including the load-balancing and z-losses, grad norms and full parameters
(router, stacked experts, the shared expert and its gate, Qwen3's q/k norms) equal to one process within 1e-10.

The model: qwen3-moe-tiny shrunk to 3 layers (MoE, dense, MoE: mlp_only_layers = [1]), 8 experts, top-2, heads of
32 (not d_model / n_head), with a gated shared expert added and a z-loss. Data parallelism: the expert counts of the
aux loss are the whole batch's (all-reduced over dp x cp), so dp 2 x micro-batch 4 equals one process's micro-batch
8 (as Megatron's global aux loss); accumulation steps do not pool (each is its own micro-batch's aux loss).
Expert parallelism is parallel/expert/'s (its own tests)."""

from __future__ import annotations

import functools

import pytest
from harness import run_distributed
from parity_helpers import assert_same_training, train_run
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

MOE = {"preset": "qwen3-moe-tiny", "n_layer": 3, "vocab_size": 300, "moe_shared_experts": 1, "moe_shared_d_ff": 16,
       "moe_shared_gate": True, "moe_aux_loss_coef": 0.05, "moe_z_loss_coef": 0.01}


LAYER = dict(MOE, moe_aux_loss_scope="layer")  # pipeline stages: each layer's own auxiliary losses


@functools.cache
def reference(micro_batch: int, grad_accum: int, scope: str = "model"):
    model = MOE if scope == "model" else LAYER
    return train_run(tiny_resolved(model=model, train={"micro_batch": micro_batch, "grad_accum": grad_accum}),
                     Topology.solo())


def _run(parallel: dict, train: dict, zero: dict | None = None, model: dict = MOE):
    res = tiny_resolved(model=model, parallel=parallel, train=train, zero=zero or {})
    par = res.recipe.parallel

    def work():
        trainer = Trainer(res, Topology.of(par))
        result = trainer.fit()
        return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                "params": trainer.full_state_dict()}

    return run_distributed(work, res.world_size)


def test_reference_learns_and_holds_the_moe_parameters():
    ref = reference(8, 1)
    assert ref["losses"][-1] < ref["losses"][0]
    assert {"h.0.mlp.router.weight", "h.2.mlp.experts.c_fc.weight", "h.0.mlp.shared_gate.weight",
            "h.1.mlp.c_fc.weight", "h.0.attn.q_norm.weight"} <= ref["params"].keys()


@pytest.mark.parametrize("parallel, train, zero, ref", [
    ({"tp": 2}, {"micro_batch": 8}, None, (8, 1)),
    ({"tp": 2, "sequence_parallel": True}, {"micro_batch": 8}, None, (8, 1)),
    ({"tp": 2}, {"micro_batch": 8, "activation_checkpointing": True}, None, (8, 1)),
    ({"dp": 2}, {"micro_batch": 4}, {"stage": 1}, (8, 1)),
    ({"dp": 2, "tp": 2}, {"micro_batch": 4}, {"stage": 2}, (8, 1)),
    ({"dp": 2}, {"micro_batch": 4}, {"stage": 3}, (8, 1)),
    ({"cp": 2, "cp_attention": "ring"}, {"micro_batch": 8}, None, (8, 1)),
], ids=["tp2", "tp2-sequence-parallel", "tp2-activation-checkpointing", "dp2-zero1", "dp2-tp2-zero2", "dp2-zero3",
        "cp2-ring"])
def test_layout_equals_one_process(parallel, train, zero, ref):
    for got in _run(parallel, train, zero):
        assert_same_training(got, reference(*ref))


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pipeline_with_layer_scope_equals_one_process(schedule):
    for got in _run({"pp": 2, "schedule": schedule}, {"micro_batch": 2, "grad_accum": 4}, model=LAYER):
        assert_same_training(got, reference(2, 4, "layer"))


def _continue_at(parallel: dict, source: str, run_dir: str):
    res = tiny_resolved(model=MOE, parallel=parallel, train={"micro_batch": 8}, run={"dir": run_dir})
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    start = trainer.load_checkpoint(source)
    result = trainer.fit(start_step=start)
    return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
            "params": trainer.full_state_dict()}


def test_checkpoint_of_one_process_continues_at_tp2(tmp_path):
    """The stacked experts, router and gate go through the sharded checkpoint: saved after 5 steps in one process,
    continued at tp 2 with sequence parallelism exactly as the uninterrupted reference."""
    res = tiny_resolved(model=MOE, train={"micro_batch": 8}, run={"dir": str(tmp_path / "solo")})
    trainer = Trainer(res, Topology.solo())
    for step in range(5):
        trainer.train_step(step)
    trainer.save_checkpoint(5)
    source = str(tmp_path / "solo" / "checkpoints" / "step_00000005")
    ref = reference(8, 1)
    ref = {"losses": ref["losses"][5:], "norms": ref["norms"][5:], "val": ref["val"], "params": ref["params"]}
    for got in run_distributed(_continue_at, 2, {"tp": 2, "sequence_parallel": True}, source, str(tmp_path / "tp2")):
        assert_same_training(got, ref)


def test_recipe_sets_the_moe_fields():
    """[model] overrides every MoE field, the dense-layer list as a TOML array; bad values are refused by name."""
    from megazoo.recipes.config import RecipeError

    res = tiny_resolved(model=dict(MOE, moe_dense_layers=[0, 2], n_layer=4))
    assert res.model.moe_dense_layers == (0, 2) and [i for i in range(4) if res.model.moe_layer(i)] == [1, 3]
    with pytest.raises(RecipeError, match=r"model.moe_dense_layers\[0\] = 'x' has the wrong type"):
        tiny_resolved(model=dict(MOE, moe_dense_layers=["x"]))
    with pytest.raises(RecipeError, match="model.moe_top_k = 9 is larger than model.n_experts = 8"):
        tiny_resolved(model=dict(MOE, moe_top_k=9))
