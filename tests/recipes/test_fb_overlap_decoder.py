"""The real decoder chunk (models/transformer.GPT, its MoE blocks models/moe/block.py) as the forward/backward
overlap's sub-stages (recipes/training/model_setup.overlap_sub_stages): a shrunk deepseek-tiny (MLA, a dense first
layer, sigmoid_bias routing with its load, a shared expert, "layer"-scope aux and z losses), fp64, pp 2 x dp 2
with ep 2, DualPipe-V over 4 virtual stages, through OverlapPipelineEngine equals the ordinary PipelineEngine
running GPT.forward: losses, every parameter gradient and the routing load bit for bit, with all-to-alls of both
directions overlapped; and the cases the sub-stages do not cover are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import run_distributed
from megazoo.models.moe import MoE
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.pipeline.engine import PipelineEngine
from megazoo.parallel.pipeline.fb_overlap import Events, overlapped
from megazoo.parallel.pipeline.overlap_engine import OverlapPipelineEngine
from megazoo.parallel.pipeline.p2p import plan_for
from megazoo.parallel.topology import Topology
from megazoo.recipes.training.model_setup import overlap_sub_stages

CFG = dataclasses.replace(get_preset("deepseek-tiny"), n_layer=4, d_model=32, n_head=2, n_kv_head=2, d_ff=48, vocab_size=64,
                          n_positions=32, n_experts=4, moe_d_ff=16, moe_n_group=2, moe_topk_group=1,
                          moe_aux_loss_scope="layer", moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
F64, M, B, S, TOL = torch.float64, 4, 2, 8, 0.0  # bit for bit: the same ops, gradients summed in the same order


def _chunks(topo: Topology) -> list[GPT]:
    r = topo.pp_rank
    chunks = []
    for stage in (r, 3 - r):  # the V: pp rank r holds stages r and 3 - r
        gpt = GPT(CFG, topo, layers=range(stage, stage + 1), with_embedding=stage == 0, with_head=stage == 3,
                  dtype=F64)
        init_weights(gpt, seed=3)
        chunks.append(gpt)
    return chunks


def _run(topo: Topology, overlap: bool):
    chunks = _chunks(topo)
    cls = OverlapPipelineEngine if overlap else PipelineEngine
    extra = {"sub_stages": overlap_sub_stages} if overlap else {}
    engine = cls(chunks, topo, hidden_size=CFG.d_model, activation_dtype=F64, placement="v",
                 loss_fn=lambda logits, y: chunks[1].loss(logits, y), **extra)
    g = torch.Generator().manual_seed(10 + topo.dp_rank)
    data = [(torch.randint(0, CFG.vocab_size, (B, S), generator=g),
             torch.randint(0, CFG.vocab_size, (B, S), generator=g)) for _ in range(M)]
    losses = engine.run(data, plan_for("dualpipev", M, 2, topo.pp_rank, 2))
    grads = {f"{c}.{n}": p.grad.clone() for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()
             if p.grad is not None}
    n_params = sum(1 for chunk in chunks for _ in chunk.parameters())
    loads = {f"{c}.{n}": b.clone() for c, chunk in enumerate(chunks) for n, b in chunk.named_buffers()
             if n.endswith("load")}
    return [float(x) for x in losses], grads, n_params, loads, engine.events.log if overlap else []


def _parity():
    topo = Topology.build(2, 1, 2, ep=2)
    plain, ours = _run(topo, False), _run(topo, True)
    assert plain[0] == pytest.approx(ours[0], abs=TOL, rel=0) and (topo.pp_rank != 0 or len(plain[0]) == M)
    assert len(plain[1]) == plain[2] and plain[1].keys() == ours[1].keys()  # every parameter got a gradient
    for name, want in plain[1].items():
        torch.testing.assert_close(ours[1][name], want, rtol=0, atol=TOL, msg=name)
    assert plain[3].keys() == ours[3].keys() and len(plain[3]) >= 1
    for name, want in plain[3].items():
        assert torch.equal(ours[3][name], want) and want.sum() > 0, name
    seen = overlapped(Events(ours[4]))
    directions = {p for _, _, p, _, _ in seen}
    # refusals: what the sub-stages do not build, by field
    refused = []
    for cfg, kw in ((CFG, {"activation_checkpointing": True}), (dataclasses.replace(CFG, moe_capacity_factor=1.5), {}),
                    (dataclasses.replace(CFG, moe_aux_loss_scope="model"), {})):
        gpt = GPT(cfg, topo, layers=range(1, 2), with_embedding=False, with_head=False, dtype=F64, device="meta",
                  **kw)
        with pytest.raises(ValueError) as err:
            overlap_sub_stages(gpt)
        refused.append(str(err.value))
    return topo.pp_rank, len(plain[1]), directions, refused


def test_sub_staged_decoder_under_dualpipev_overlap_equals_the_ordinary_engine_at_pp2_ep2():
    runs = run_distributed(_parity, 4)
    for pp_rank, n_grads, directions, refused in runs:
        assert n_grads > 10 and directions == {"F", "B"}, (pp_rank, n_grads, directions)
        assert "train.activation_checkpointing" in refused[0] and "valid: false" in refused[0]
        assert "model.moe_capacity_factor = 1.5" in refused[1]
        assert "model.moe_aux_loss_scope" in refused[2] and "valid: 'layer'" in refused[2]


MOE = {"preset": "llama-tiny", "n_layer": 4, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
       "vocab_size": 300, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": 16, "moe_first_dense": 1, "dropout": 0.0,
       "attn_dropout": 0.0, "moe_aux_loss_scope": "layer", "moe_aux_loss_coef": 0.05, "moe_z_loss_coef": 0.01}


# under autocast: a shared expert (its gradient meets the routed rows' at the block's MoE input) and top-3
AUTOCAST_MOE = {**MOE, "moe_shared_experts": 1, "moe_top_k": 3}


def _train(fb_overlap: bool, precision: str = "fp64", zero: int = 0, model: dict = MOE):
    from recipe_helpers import tiny_resolved

    from megazoo.recipes.training.trainer import Trainer
    res = tiny_resolved(model=model, parallel={"fb_overlap": fb_overlap, "pp": 2, "dp": 2, "ep": 2,
                                             "schedule": "dualpipev"},
                        train={"steps": 2, "micro_batch": 2, "grad_accum": 4, "precision": precision,
                               "fused_loss": "off"}, zero={"stage": zero})
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    metrics = [trainer.train_step(step) for step in range(2)]
    params = {f"{c}.{n}": p.detach().clone() for c, chunk in enumerate(trainer.chunks)
              for n, p in chunk.named_parameters()}
    return type(trainer.engine).__name__, metrics, params


def test_trainer_with_fb_overlap_equals_the_trainer_without_it():
    """Two fp64 optimizer steps of the Trainer (ZeRO's reductions, the MoE metrics' hooks, the layer-scope losses)
    with parallel.fb_overlap on equal them with it off: losses, MoE figures and every parameter bit for bit."""
    on, off = run_distributed(_train, 4, True), run_distributed(_train, 4, False)
    for (engine, metrics, params), (plain, ref_metrics, ref_params) in zip(on, off):
        assert engine == "OverlapPipelineEngine" and plain == "PipelineEngine"
        for got, ref in zip(metrics, ref_metrics):
            assert got["loss"] == pytest.approx(ref["loss"], abs=TOL, rel=0)
            for key in ("moe_aux_loss", "moe_z_loss", "moe_load_max"):
                assert torch.tensor(got[key]).double().allclose(torch.tensor(ref[key]).double(), rtol=0, atol=TOL)
        assert params.keys() == ref_params.keys()
        for name, want in ref_params.items():
            torch.testing.assert_close(params[name], want, rtol=0, atol=TOL, msg=name)
        assert metrics[0]["loss"] != metrics[1]["loss"]  # the steps trained


@pytest.mark.parametrize("precision, zero", [("bf16", 0), ("bf16", 1), ("fp16", 0)])
def test_trainer_with_fb_overlap_under_autocast_equals_the_trainer_without_it(precision, zero):
    """bf16 / fp16 autocast (each compute sub-stage under the recipe's autocast; fp16 with its loss scaler), a
    shared expert and top-3: two Trainer steps with fb_overlap on equal them with it off bit for bit - the same
    ops in the same dtypes, each gradient summed in the same order, only run in another order."""
    on, off = (run_distributed(_train, 4, overlap, precision, zero, AUTOCAST_MOE) for overlap in (True, False))
    for (engine, metrics, params), (plain, ref_metrics, ref_params) in zip(on, off):
        assert engine == "OverlapPipelineEngine" and plain == "PipelineEngine"
        for got, ref in zip(metrics, ref_metrics):
            for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_max"):
                assert got[key] == ref[key], (key, got[key], ref[key])
        assert params.keys() == ref_params.keys()
        for name, want in ref_params.items():
            assert params[name].dtype == want.dtype
            torch.testing.assert_close(params[name], want, rtol=0, atol=0, msg=name)
        assert metrics[0]["loss"] != metrics[1]["loss"]
