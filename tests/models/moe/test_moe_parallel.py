"""Tensor parallelism of an MoE model against one process, fp64 to 1e-10: the training loss (cross-entropy + aux
+ z-loss), and every full gradient (router, stacked experts, shared experts and their gate, Qwen3's q/k norms
included) at tp = 2, tp = 2 with sequence parallelism (each rank routes its own positions; replicated weights'
gradients all-reduced over tp) and tp = 4 (key/value heads, and so k_norm's inputs, replicated)."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

from megazoo.models.config import ModelConfig
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.tensor import gather_full, named_shards
from megazoo.parallel.topology import Topology

CFG = ModelConfig("moe-parity", n_layer=3, n_head=4, n_kv_head=2, d_model=32, d_ff=48, n_positions=32,
                  vocab_size=96, vocab_multiple=8, norm="rmsnorm", positions="rotary", mlp="swiglu",
                  tie_embeddings=False, qkv_bias=False, proj_bias=False, mlp_bias=False, dropout=0.0,
                  attn_dropout=0.0, head_width=16, qk_norm=True, n_experts=4, moe_top_k=2, moe_d_ff=16,
                  moe_shared_experts=2, moe_shared_d_ff=8, moe_shared_gate=True, moe_dense_layers=(1,),
                  moe_norm_topk_prob=False, moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01)
IDS = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))


def _loss_and_grads(topo: Topology):
    model = GPT(CFG, topo, dtype=torch.float64)
    init_weights(model, 3)
    model.train()
    ids = IDS
    loss = model.loss(model(ids), ids)
    loss.backward()
    grads = {name: gather_full(param.grad, spec, topo.tp_group) for name, param, spec in named_shards(model)}
    counts = torch.stack([s.counts for s in model.moe_stats()])
    return loss.detach(), grads, counts


@pytest.mark.parametrize("tp, sp", [(2, False), (2, True), (4, False)])
def test_tensor_parallel_moe_equals_one_process(tp, sp):
    ref_loss, ref_grads, ref_counts = _loss_and_grads(Topology.solo())
    assert any(".mlp.experts." in n for n in ref_grads) and "h.0.attn.k_norm.weight" in ref_grads
    for loss, grads, counts in run_distributed(
            lambda: _loss_and_grads(Topology.build(dp=1, tp=tp, sequence_parallel=sp)), tp):
        assert abs(loss.item() - ref_loss.item()) < 1e-10
        assert torch.equal(counts, ref_counts)  # the expert loads: summed over tp under sequence parallelism
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert (grad - ref_grads[name]).abs().max().item() < 1e-10, name
