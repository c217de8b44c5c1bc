"""DeepSeek-V3's routing bias in the real Trainer: moved after every step from the step's load counted over every
routing rank, so dp 2 x ep 2 (ZeRO-1), with tp 2 under sequence parallelism and with pp 2 equal one process
running the same micro-batches: losses, gradient norms, every parameter and every layer's router.expert_bias
(a buffer in the full state dict) to 1e-10 in fp64, and the bias has moved off zero. The bias is in the
checkpoint: saved at dp 2 x ep 2 after 2 steps and resumed in one process, the run equals the uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from parity_helpers import assert_same_training, train_run
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.training.trainer import Trainer

DEEPSEEK = {"preset": "llama-tiny", "n_layer": 3, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
            "vocab_size": 300, "n_experts": 8, "moe_top_k": 2, "moe_d_ff": 16, "moe_shared_experts": 1,
            "moe_first_dense": 1, "moe_router": "sigmoid_bias", "moe_n_group": 4, "moe_topk_group": 2,
            "moe_routed_scaling_factor": 2.5, "moe_bias_update_rate": 0.01, "moe_seq_aux_loss_coef": 0.05,
            "dropout": 0.0, "attn_dropout": 0.0}
STEPS = 3


def _res(parallel: dict, grad_accum: int, run_dir: str | None = None, model: dict | None = None):
    return tiny_resolved(model={**DEEPSEEK, **(model or {})}, parallel=parallel, zero={"stage": 1}, run={"dir": run_dir} if run_dir else {},
                         train={"steps": STEPS, "micro_batch": 2, "grad_accum": grad_accum, "eval_batches": 1})


@pytest.fixture(scope="module")
def reference():
    return train_run(_res({}, 4), Topology.solo())


def _biases(params: dict) -> dict:
    return {name: value for name, value in params.items() if name.endswith("router.expert_bias")}


def test_reference_moves_the_bias(reference):
    biases = _biases(reference["params"])
    assert sorted(biases) == ["h.1.mlp.router.expert_bias", "h.2.mlp.router.expert_bias"]  # layer 0 is dense
    for value in biases.values():
        assert value.abs().max() > 0 and value.abs().max() <= STEPS * 0.01 + 1e-12


@pytest.mark.parametrize("parallel, grad_accum", [
    ({"dp": 2, "ep": 2}, 2),
    ({"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}, 2),  # each tp rank counts its own positions
])
def test_bias_update_equals_one_process(reference, parallel, grad_accum):
    """The sequence-wise balance loss on too: under sequence parallelism its sums run over the tp ranks."""
    res = _res(parallel, grad_accum)
    for got in run_distributed(lambda: train_run(res, Topology.of(res.recipe.parallel)), res.world_size):
        assert_same_training(got, reference)  # expert_bias included: it is in the full state dict
        for name, value in _biases(reference["params"]).items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0, msg=name)


def test_bias_update_under_pp2():
    """Each stage moves its own layers' biases. The sequence-wise loss is off: under pp the first stage's router
    losses do not reach the last stage's loss yet (the model-scope gap of every MoE router loss)."""
    off = {"moe_seq_aux_loss_coef": 0.0}
    ref = train_run(_res({}, 4, model=off), Topology.solo())
    res = _res({"dp": 2, "pp": 2, "ep": 2}, 2, model=off)
    for got in run_distributed(lambda: train_run(res, Topology.of(res.recipe.parallel)), res.world_size):
        assert_same_training(got, ref)


def _save_after(steps: int, run_dir: str) -> None:
    res = _res({"dp": 2, "ep": 2}, 2, run_dir)
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    for step in range(steps):
        trainer.train_step(step)
    trainer.save_checkpoint(steps)


def test_bias_saved_and_resumed(tmp_path, reference):
    run_distributed(_save_after, 2, 2, str(tmp_path / "saved"))
    trainer = Trainer(_res({}, 4, str(tmp_path / "resumed")), Topology.solo())
    start = trainer.load_checkpoint(str(tmp_path / "saved" / "checkpoints" / f"step_{2:08d}"))
    assert start == 2 and all(b.abs().max() > 0 for b in _biases(trainer.full_state_dict()).values())
    result = trainer.fit(start_step=start)
    assert_same_training({"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                          "params": trainer.full_state_dict()},
                         {**reference, "losses": reference["losses"][2:], "norms": reference["norms"][2:]})


def test_resolver_refuses_the_sequence_loss_under_cp():
    with pytest.raises(RecipeError, match=r"model.moe_seq_aux_loss_coef = 0.05 .* parallel.cp = 2"):
        _res({"cp": 2}, 4)
    assert _res({"cp": 2}, 4, model={"moe_seq_aux_loss_coef": 0.0}).recipe.parallel.cp == 2
