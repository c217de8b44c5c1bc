"""Expert parallelism in the real Trainer: a tiny MoE trained at ep 2 (and with ZeRO, tp) equals one process.

The recipe: llama-tiny shrunk to 2 layers with 4 routed experts (top-2) in every layer, a shared expert, the
load-balancing aux loss and the z-loss on, fp64, clipping active. The aux loss counts every dp x cp rank's tokens
(models/moe/losses.py), so the one-process reference holds the dp ranks' micro-batches as one (no accumulation:
accumulation steps do not pool, and the sampler gives a rank consecutive samples, so accumulated layouts run other
micro-batches than any one process): losses, gradient norms and every full parameter after the steps (the experts
gathered over the ep ranks) equal to 1e-10. With the router losses off, any split computes the same function.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from parity_helpers import assert_same_training, train_run
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

MOE = {"preset": "llama-tiny", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
       "vocab_size": 300, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": 16, "moe_shared_experts": 1,
       "moe_shared_d_ff": 8, "moe_aux_loss_coef": 0.05, "moe_z_loss_coef": 0.01, "dropout": 0.0,
       "attn_dropout": 0.0}
STEPS = 4


def _res(parallel: dict, micro_batch: int, grad_accum: int, zero: dict | None = None, model: dict | None = None):
    return tiny_resolved(model={**MOE, **(model or {})}, parallel=parallel, zero=zero or {},
                         train={"steps": STEPS, "micro_batch": micro_batch, "grad_accum": grad_accum,
                                "eval_batches": 1})


_REFERENCES: dict = {}


def _reference(micro_batch: int, model: dict | None = None):
    """One process running the global batch of 8 in micro-batches of `micro_batch` (the layouts' dp x micro)."""
    key = (micro_batch, tuple(sorted((model or {}).items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = train_run(_res({}, micro_batch, 8 // micro_batch, model=model), Topology.solo())
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def reference():
    return _reference(8)


def _on_ranks(parallel: dict, micro_batch: int, grad_accum: int, zero: dict | None = None,
              model: dict | None = None):
    res = _res(parallel, micro_batch, grad_accum, zero, model)
    par = res.recipe.parallel

    def work():
        topo = Topology.of(par)
        trainer = Trainer(res, topo)
        result = trainer.fit()
        moe = next((block.mlp for block in trainer.chunks[0].h.values() if hasattr(block.mlp, "dispatcher")), None)
        return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                "params": trainer.full_state_dict(), "local_experts": moe and moe.dispatcher.local_experts,
                "ep_rank": topo.ep_rank, "all_to_all": trainer.zero.comm.bytes.get("all_to_all", 0)}

    results = run_distributed(work, res.world_size)
    ep = par.ep
    for got in results:  # each rank held only its ep rank's block of experts (a stage of dense layers: none)
        n = MOE["n_experts"] // ep
        assert got["local_experts"] in (None, range(got["ep_rank"] * n, (got["ep_rank"] + 1) * n))
        assert (got.pop("all_to_all") > 0) == (ep > 1 and got["local_experts"] is not None)  # in its traffic
    return results


def test_reference_learns_and_routes(reference):
    assert len(reference["losses"]) == STEPS and reference["losses"][-1] < reference["losses"][0]
    assert any(".mlp.experts." in name for name in reference["params"])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_ep2_equals_one_process(reference, zero):
    for got in _on_ranks({"dp": 2, "ep": 2}, 4, 1, {"stage": zero}):
        assert_same_training(got, reference)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_dp4_is_ep2_by_edp2(reference, zero):
    """dp 4 = ep 2 x expert-data-parallel 2: expert gradients reduce-scattered over the edp pair."""
    for got in _on_ranks({"dp": 4, "ep": 2}, 2, 1, {"stage": zero}):
        assert_same_training(got, reference)


@pytest.mark.parametrize("sp, zero", [(False, 0), (True, 0), (True, 3)])
def test_ep2_with_tp2(reference, sp, zero):
    """Experts at expert-tp 1 (replicated over tp), attention and shared experts at tp 2."""
    for got in _on_ranks({"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": sp}, 4, 1, {"stage": zero}):
        assert_same_training(got, reference)


LAYER_SCOPE = {"moe_aux_loss_scope": "layer"}  # pipeline stages: each layer's own router losses


def _reference_of_ranks(dp: int, micro_batch: int, grad_accum: int, model: dict):
    """One process running what dp ranks of `micro_batch` x `grad_accum` run together: its k-th micro-batch is
    every rank's k-th (the router losses' counts pool over dp x cp per micro-batch, and the sampler gives a rank
    consecutive samples), so accumulation steps pool the same rows as the layout's."""
    res = _res({}, dp * micro_batch, grad_accum, model=model)
    trainer = Trainer(res, Topology.solo())
    per_rank = micro_batch * grad_accum

    def interleaved(step: int) -> list[list[int]]:
        g = trainer.sampler.global_indices_for_step(step)
        return [[i for r in range(dp) for i in g[r * per_rank + k * micro_batch:r * per_rank + (k + 1) * micro_batch]]
                for k in range(grad_accum)]

    trainer.sampler.indices_for_step = interleaved
    result = trainer.fit()
    return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
            "params": trainer.full_state_dict()}


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_ep2_with_pp2(schedule):
    """The all-to-all inside pipeline stages (zb_h1: the experts' weight gradients in the deferred W pass), with
    the router losses on in the pipeline's scope ("layer", injected in backward scaled as the loss: 1 / the
    step's micro-batches) and two accumulation steps."""
    for got in _on_ranks({"dp": 2, "pp": 2, "ep": 2, "schedule": schedule}, 2, 2, {"stage": 1},
                         model=LAYER_SCOPE):
        assert_same_training(got, _reference_of_ranks(2, 2, 2, LAYER_SCOPE))


def test_ep2_with_pp2_whose_first_stage_has_no_experts():
    """DeepSeek-style first dense layers filling stage 0: that stage's ranks hold no expert half, yet join the
    grad norm's ep and pp all-reduces the expert stage runs (they were refused: "no expert parameters")."""
    model = {**LAYER_SCOPE, "moe_first_dense": 1}
    results = _on_ranks({"dp": 2, "pp": 2, "ep": 2}, 2, 2, {"stage": 1}, model=model)
    assert sum(got["local_experts"] is None for got in results) == 2  # the two stage-0 ranks
    for got in results:
        assert_same_training(got, _reference_of_ranks(2, 2, 2, model))


@pytest.mark.parametrize("parallel, micro_batch, grad_accum, reference_micro", [
    ({"cp": 2, "ep": 2}, 8, 1, 8),  # ep spans the two cp ranks of one sequence
    ({"dp": 2, "cp": 2, "ep": 4}, 4, 1, 8),  # ep spans dp x cp, expert-data-parallel 1
    ({"dp": 2, "cp": 2, "ep": 2}, 4, 1, 8),  # ep over cp, the experts' gradients reduced over dp
])
def test_ep_with_cp(parallel, micro_batch, grad_accum, reference_micro):
    for got in _on_ranks(parallel, micro_batch, grad_accum, {"stage": 1}):
        assert_same_training(got, _reference(reference_micro))


def test_ep2_with_activation_checkpointing(reference):
    """The recomputed forward runs the dispatch's all-to-alls again inside backward, on every ep rank alike."""
    res = tiny_resolved(model=MOE, parallel={"dp": 2, "ep": 2},
                        train={"steps": STEPS, "micro_batch": 4, "grad_accum": 1, "eval_batches": 1,
                               "activation_checkpointing": True})
    assert res.recipe.train.activation_checkpointing
    for got in run_distributed(lambda: train_run(res, Topology.of(res.recipe.parallel)), 2):
        assert_same_training(got, reference)


def test_ep2_with_lora_on_attention():
    """LoRA on q and v: the experts (frozen, like every base weight) stay on their ep rank, outside the optimizer."""
    lora = {"rank": 4, "targets": ["q", "v"]}
    ref_res = tiny_resolved(model=MOE, lora=lora, train={"steps": STEPS, "micro_batch": 8, "grad_accum": 1,
                                                         "eval_batches": 1})
    ref = train_run(ref_res, Topology.solo())
    res = tiny_resolved(model=MOE, lora=lora, parallel={"dp": 2, "ep": 2}, zero={"stage": 2},
                        train={"steps": STEPS, "micro_batch": 4, "grad_accum": 1, "eval_batches": 1})
    assert ref["losses"][-1] != ref["losses"][0]  # the adapters trained
    for got in run_distributed(lambda: train_run(res, Topology.of(res.recipe.parallel)), 2):
        assert_same_training(got, ref)


@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-5), ("bf16", 1e-3), ("fp16", 1e-3)])
def test_ep2_in_lower_precision(precision, rtol):
    """fp32, bf16 and fp16 (autocast, 16-bit all-to-alls of the rows; fp16 with dynamic loss scaling, its overflow
    check over both optimizer halves): the losses of ep 2 stay within the precision's reduction-order rounding of
    one process's (16 bits: a fraction of the 2^-8 / 2^-11 epsilon; bf16 measured 1.6e-6 here)."""
    train = {"steps": 3, "grad_accum": 1, "eval_batches": 1, "precision": precision}
    ref = train_run(tiny_resolved(model=MOE, train={**train, "micro_batch": 8}), Topology.solo())
    res = tiny_resolved(model=MOE, parallel={"dp": 2, "ep": 2}, zero={"stage": 1}, train={**train, "micro_batch": 4})
    for got in run_distributed(lambda: train_run(res, Topology.of(res.recipe.parallel)), 2):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
