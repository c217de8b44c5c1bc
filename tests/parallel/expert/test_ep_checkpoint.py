"""Checkpoints across expert-parallel layouts: saved at ep 2 (each rank its half of the experts, their Adam
moments partitioned over the expert-data-parallel group), loaded at ep 1 and ep 4 (and saved at ep 1, loaded at
ep 2), the continued run equals the uninterrupted single-process one: losses, norms, parameters to 1e-10.

The router losses are off here: they are per micro-batch, and the layouts below split the global batch into
different micro-batches (tests/parallel/expert/test_ep_training.py holds them with the router losses on).
"""

from __future__ import annotations

import pytest
from harness import run_distributed
from parity_helpers import assert_same_training
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

MOE = {"preset": "llama-tiny", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
       "vocab_size": 300, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": 16, "moe_shared_experts": 1,
       "moe_shared_d_ff": 8, "dropout": 0.0, "attn_dropout": 0.0}
STEPS, SAVE_AT = 4, 2


def _res(par: dict, zero: dict, run_dir: str):
    dp = par.get("dp", 1)
    return tiny_resolved(model=MOE, parallel=par, zero=zero, run={"dir": run_dir},
                         train={"steps": STEPS, "micro_batch": 8 // dp, "eval_batches": 1})


def _train_and_save(par: dict, zero: dict, run_dir: str):
    res = _res(par, zero, run_dir)
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    for step in range(SAVE_AT):
        trainer.train_step(step)
    trainer.save_checkpoint(SAVE_AT)


def _continue_from(par: dict, zero: dict, source: str, run_dir: str):
    res = _res(par, zero, run_dir)
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    start = trainer.load_checkpoint(source)
    result = trainer.fit(start_step=start)
    return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
            "params": trainer.full_state_dict()}


def _run(fn, par: dict, *args):
    world = par.get("dp", 1)
    return run_distributed(fn, world, par, *args) if world > 1 else [fn(par, *args)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    trainer = Trainer(_res({}, {}, str(tmp_path_factory.mktemp("reference"))), Topology.solo())
    result = trainer.fit()
    return {"losses": result.losses[SAVE_AT:], "norms": result.grad_norms[SAVE_AT:], "val": result.val_loss,
            "params": trainer.full_state_dict()}


@pytest.mark.parametrize("saved, loaded", [
    (({"dp": 2, "ep": 2}, {"stage": 1}), ({}, {})),  # ep 2 -> one process
    (({"dp": 2, "ep": 2}, {"stage": 1}), ({"dp": 4, "ep": 4}, {"stage": 2})),  # ep 2 -> ep 4
    (({}, {}), ({"dp": 2, "ep": 2}, {"stage": 3})),  # one process -> ep 2 under ZeRO-3
], ids=["ep2-to-ep1", "ep2-to-ep4", "ep1-to-ep2"])
def test_resume_in_another_expert_layout(tmp_path, reference, saved, loaded):
    _run(_train_and_save, saved[0], saved[1], str(tmp_path / "saved"))
    source = str(tmp_path / "saved" / "checkpoints" / f"step_{SAVE_AT:08d}")
    for got in _run(_continue_from, loaded[0], loaded[1], source, str(tmp_path / "loaded")):
        assert_same_training(got, reference)
