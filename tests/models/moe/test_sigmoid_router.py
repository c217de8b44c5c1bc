"""DeepSeek-V3's routing (moe_router = "sigmoid_bias"): sigmoid scores, selection over scores + a per-expert bias
(never in the weights, no gradient), group-limited (n_group, topk_group), renormalised and scaled weights.

Checked against a hand-written per-token reference and against transformers' DeepseekV3MoE (router, routed
experts, ungated shared experts) with its weights and a random e_score_correction_bias loaded into our MoE block;
the bias update (sign of mean load - load, after each step) against a hand computation; the config refusals.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megazoo.models.config import ModelConfig
from megazoo.models.moe import MoE, route
from megazoo.models.moe.losses import sequence_balance_loss
from megazoo.models.moe.router import Router, update_expert_bias
from megazoo.parallel.topology import Topology

BASE = dict(name="deepseek-test", n_layer=1, n_head=4, d_model=32, vocab_size=64, n_positions=32, norm="rmsnorm", positions="rotary",
            mlp="swiglu", mlp_bias=False, n_experts=8, moe_top_k=3, moe_d_ff=16, moe_router="sigmoid_bias")


def reference_route(logits, bias, top_k, n_group, topk_group, norm, scaling):
    """Token by token, in plain Python: the groups by the sum of their two best biased scores, then the top-k
    biased scores inside the kept groups, weighted by the unbiased scores."""
    scores = torch.sigmoid(logits.double())
    n_experts = scores.shape[1]
    size = n_experts // n_group
    out_w, out_i = [], []
    for row in scores:
        biased = [float(row[e]) + float(bias[e]) for e in range(n_experts)]
        group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for e in range(n_experts) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:top_k]
        w = [float(row[e]) for e in chosen]
        if norm:
            w = [x / sum(w) for x in w]
        out_w.append(dict(zip(chosen, [x * scaling for x in w])))
    return out_w


@pytest.mark.parametrize("n_group, topk_group, norm", [(1, 1, True), (4, 2, True), (4, 1, False), (2, 2, True)])
def test_route_equals_hand_reference(n_group, topk_group, norm):
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    logits = torch.randn(40, 8, generator=g)
    bias = torch.randn(8, generator=g) * 0.3  # large enough to change choices: selection differs from the scores'
    weights, indices, scores = route(logits, 2, "sigmoid_bias", norm, bias=bias, n_group=n_group,
                                     topk_group=topk_group, scaling=2.5)
    torch.testing.assert_close(scores, torch.sigmoid(logits))
    for t, expected in enumerate(reference_route(logits, bias, 2, n_group, topk_group, norm, 2.5)):
        got = dict(zip(indices[t].tolist(), weights[t].tolist()))
        assert got.keys() == expected.keys(), t
        for e in expected:
            assert abs(got[e] - expected[e]) < 1e-6
    unbiased = route(logits, 2, "sigmoid_bias", norm, bias=None, n_group=n_group, topk_group=topk_group)[1]
    assert not torch.equal(unbiased.sort(-1).values, indices.sort(-1).values)  # the bias did steer the choice


def test_bias_selects_but_gets_no_gradient():
    logits = torch.randn(10, 8, requires_grad=True)
    bias = torch.zeros(8, requires_grad=True)
    weights, _, _ = route(logits, 2, "sigmoid_bias", True, bias=bias, n_group=4, topk_group=2)
    weights.sum().backward()
    assert bias.grad is None and logits.grad is not None


def _hf_moe(**changes):
    cfg = transformers.DeepseekV3Config(**{
        **dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
               num_attention_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, n_group=4,
               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0), **changes})
    torch.manual_seed(0)
    hf = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0, 0.1)
    return cfg, hf.eval()


@pytest.mark.parametrize("hf_changes, ours", [
    ({}, {}),
    ({"n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
     {"moe_n_group": 1, "moe_topk_group": 1, "moe_norm_topk_prob": False, "moe_routed_scaling_factor": 1.0}),
])
def test_moe_equals_transformers_deepseek_v3(hf_changes, ours):
    hf_cfg, hf = _hf_moe(**hf_changes)
    cfg = ModelConfig(**{**BASE, "moe_shared_experts": 2, "moe_n_group": 4, "moe_topk_group": 2,
                         "moe_routed_scaling_factor": 2.5, **ours})
    moe = MoE(cfg, Topology.solo()).eval()
    with torch.no_grad():
        moe.router.weight.copy_(hf.gate.weight)
        moe.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
        moe.experts.c_fc.weight.copy_(hf.experts.gate_up_proj)
        moe.experts.c_proj.weight.copy_(hf.experts.down_proj)
        s = hf.shared_experts
        moe.shared.c_fc.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
        moe.shared.c_proj.weight.copy_(s.down_proj.weight)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    _, hf_w, hf_i = hf.gate(x)
    ours_w, ours_i, _ = route(moe.router(x.view(-1, 32)), 3, "sigmoid_bias", cfg.moe_norm_topk_prob,
                              bias=moe.router.expert_bias, n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
                              scaling=cfg.moe_routed_scaling_factor)
    order_hf, order_ours = hf_i.argsort(-1), ours_i.argsort(-1)
    assert torch.equal(hf_i.gather(1, order_hf), ours_i.gather(1, order_ours))
    torch.testing.assert_close(ours_w.gather(1, order_ours), hf_w.gather(1, order_hf), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(moe(x), hf(x), rtol=1e-5, atol=1e-5)


def test_update_expert_bias_moves_against_the_load():
    cfg = ModelConfig(**BASE)
    router = Router(cfg)
    router.load.copy_(torch.tensor([5, 1, 3, 3, 0, 7, 2, 3]))  # mean 3
    update_expert_bias([router], 0.01)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-1, 1, 0, 0, 1, -1, 1, 0]) * 0.01)
    assert not router.load.any()
    assert "expert_bias" in router.state_dict() and "load" not in router.state_dict()
    assert [n for n, _ in router.named_parameters()] == ["weight"]


@pytest.mark.parametrize("changes, message", [
    ({"moe_n_group": 3}, "moe_n_group = 3 must divide model.n_experts = 8"),
    ({"moe_n_group": 8}, "groups of 2 or more"),
    ({"moe_n_group": 2, "moe_topk_group": 3}, "moe_topk_group = 3 is larger than model.moe_n_group = 2"),
    ({"moe_n_group": 4, "moe_topk_group": 1}, "moe_top_k = 3 is more than the 2 experts"),
    ({"moe_router": "softmax", "moe_bias_update_rate": 0.001}, "they belong to moe_router = 'sigmoid_bias'"),
    ({"moe_router": "softmax", "moe_n_group": 3}, "moe_n_group = 3 must divide model.n_experts = 8"),  # DeepSeek-V2's
    ({"moe_bias_update_rate": -1.0}, "moe_bias_update_rate = -1.0 is invalid"),
    ({"moe_seq_aux_loss_coef": 1e-4, "moe_aux_loss_scope": "layer"}, "moe_seq_aux_loss_coef needs"),
    ({"moe_router": "softmax", "moe_seq_aux_loss_coef": 1e-4}, "they belong to moe_router = 'sigmoid_bias'"),
])
def test_config_refusals(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**{**BASE, **changes})


def test_sequence_balance_loss_equals_hand_reference():
    """DeepSeek-V3 eq. 17-20 per sequence in plain Python (f_e = E / (K S) x count_e, P_e = mean s'_e), averaged
    over the sequences; the gradient reaches the scores only through P."""
    g = torch.Generator().manual_seed(5)
    seqs, length, n_experts, k = 3, 7, 8, 2
    scores = torch.sigmoid(torch.randn(seqs * length, n_experts, generator=g, dtype=torch.float64))
    indices = torch.topk(scores + torch.rand(n_experts, generator=g, dtype=torch.float64), k).indices
    expected = 0.0
    for b in range(seqs):
        rows = range(b * length, (b + 1) * length)
        for e in range(n_experts):
            count = sum(int(e in indices[t].tolist()) for t in rows)
            p = sum(float(scores[t, e] / scores[t].sum()) for t in rows) / length
            expected += n_experts / (k * length) * count * p / seqs
    scores.requires_grad_(True)
    got = sequence_balance_loss(scores, indices, seqs, k)
    assert abs(got.item() - expected) < 1e-12
    got.backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0


def test_decoder_loss_adds_each_layers_sequence_loss():
    from megazoo.models.transformer import GPT
    from megazoo.models.weights import init_weights
    cfg = ModelConfig(**{**BASE, "n_layer": 2, "moe_seq_aux_loss_coef": 0.5, "moe_n_group": 4, "moe_topk_group": 2})
    torch.manual_seed(0)
    model = GPT(cfg, Topology.solo()).train()
    init_weights(model, 0)
    ids = torch.randint(0, 64, (2, 10))
    logits = model(ids)
    with_seq = model.loss(logits, ids)
    stats = model.moe_stats()
    assert len(stats) == 2 and all(s.seq_aux > 0 for s in stats)
    bare = ModelConfig(**{**BASE, "n_layer": 2, "moe_n_group": 4, "moe_topk_group": 2})
    model.cfg = bare
    torch.testing.assert_close(with_seq, model.loss(logits, ids) + 0.5 * (stats[0].seq_aux + stats[1].seq_aux))
