"""The Llama-style decoder trains the same function in every layout: the real Trainer, 10 fp64 steps with
warmup and clipping, per-step losses, grad norms and full parameters equal to one process within 1e-10.

Grouped-query attention with 2 key/value heads (split at tp 2, replicated at tp 4), an untied head (which lives
on the last pipeline stage only), RMSNorm, rotary with llama3 scaling, SwiGLU and q/k/v bias; a tied variant
through the pipeline too (its embedding is summed over the first and last stage). Activation checkpointing and
context parallelism (ring and all-to-all; rotary at each load-balanced chunk's own positions) too.
"""

from __future__ import annotations

import functools

import pytest
from harness import run_distributed
from recipe_helpers import tiny_resolved
from parity_helpers import assert_same_training, train_run

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

LLAMA = {"preset": "llama-tiny", "n_layer": 4, "vocab_size": 300, "d_model": 64, "n_head": 4, "n_kv_head": 2,
         "d_ff": 96, "qkv_bias": True, "rope_scaling": "llama3", "rope_original_positions": 16}
TIED = dict(LLAMA, tie_embeddings=True)
MODELS = {"untied": LLAMA, "tied": TIED}


@functools.cache
def reference(model: str):
    return train_run(tiny_resolved(model=MODELS[model], train={"micro_batch": 8}), Topology.solo())


def _run(model: str, parallel: dict, train: dict, zero: dict | None = None):
    res = tiny_resolved(model=MODELS[model], parallel=parallel, train=train, zero=zero or {})
    par = res.recipe.parallel

    def work():
        trainer = Trainer(res, Topology.of(par))
        result = trainer.fit()
        return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                "params": trainer.full_state_dict()}

    return run_distributed(work, res.world_size)


def test_reference_learns():
    ref = reference("untied")
    assert ref["losses"][-1] < ref["losses"][0]
    assert "lm_head.weight" in ref["params"] and "h.0.attn.c_kv.bias" in ref["params"]


@pytest.mark.parametrize("model, parallel, train, zero", [
    ("untied", {"tp": 2}, {"micro_batch": 8}, None),
    ("untied", {"tp": 4}, {"micro_batch": 8}, None),  # key/value heads replicated
    ("untied", {"pp": 2, "schedule": "1f1b"}, {"micro_batch": 2, "grad_accum": 4}, None),
    ("tied", {"pp": 2, "schedule": "1f1b"}, {"micro_batch": 2, "grad_accum": 4}, None),
    ("untied", {"dp": 2, "tp": 2}, {"micro_batch": 4}, {"stage": 1}),
    ("untied", {"dp": 2, "pp": 2, "schedule": "1f1b"}, {"micro_batch": 2, "grad_accum": 2}, {"stage": 2}),
    ("untied", {"dp": 2}, {"micro_batch": 4}, {"stage": 3}),
    ("untied", {"tp": 2}, {"micro_batch": 8, "activation_checkpointing": True}, None),
    # context parallel: rotary at the load-balanced chunks' own positions
    ("untied", {"cp": 2, "cp_attention": "ring"}, {"micro_batch": 8}, None),
    ("untied", {"tp": 2, "cp": 2, "cp_attention": "all_to_all"}, {"micro_batch": 8}, None),
], ids=["tp2", "tp4-kv-replicated", "pp2", "pp2-tied", "dp2-tp2-zero1", "dp2-pp2-zero2", "dp2-zero3",
        "tp2-activation-checkpointing", "cp2-ring", "tp2-cp2-all-to-all"])
def test_layout_equals_one_process(model, parallel, train, zero):
    for got in _run(model, parallel, train, zero):
        assert_same_training(got, reference(model))


def _continue_at(parallel: dict, source: str, run_dir: str):
    res = tiny_resolved(model=LLAMA, parallel=parallel, train={"micro_batch": 8}, run={"dir": run_dir})
    par = res.recipe.parallel
    trainer = Trainer(res, Topology.build(par.dp, par.tp, par.pp))
    start = trainer.load_checkpoint(source)
    result = trainer.fit(start_step=start)
    return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
            "params": trainer.full_state_dict()}


def test_checkpoint_of_one_process_continues_at_tp2(tmp_path):
    """The untied head's padded vocabulary differs between tp 1 (384 rows) and tp 2 (512): a checkpoint saved
    after 5 steps in one process continues at tp 2 exactly as the uninterrupted reference."""
    res = tiny_resolved(model=LLAMA, train={"micro_batch": 8}, run={"dir": str(tmp_path / "solo")})
    trainer = Trainer(res, Topology.solo())
    for step in range(5):
        trainer.train_step(step)
    trainer.save_checkpoint(5)
    source = str(tmp_path / "solo" / "checkpoints" / "step_00000005")
    ref = reference("untied")
    ref = {"losses": ref["losses"][5:], "norms": ref["norms"][5:], "val": ref["val"], "params": ref["params"]}
    for got in run_distributed(_continue_at, 2, {"tp": 2}, source, str(tmp_path / "tp2")):
        assert_same_training(got, ref)
