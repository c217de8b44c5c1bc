"""DeepSeek-V3's node-limited routing (model.moe_nodes, model.moe_max_nodes; models/moe/router.py): a token's
experts come from at most M nodes, the nodes with the highest sums of their ceil(K / M) best biased scores. Equal to
a hand-written loop and to transformers' group limit where K / M = 2; the real Trainer at dp 2 = ep 2 with one
"node" per process equals one process using the same grouping in fp64 to 1e-10 (and the limit changes training);
bad fields and layouts that would split a node's experts over nodes are refused before any process starts."""

from __future__ import annotations

import math

import pytest
import torch
from harness import run_distributed
from parity_helpers import assert_same_training, train_run
from recipe_helpers import tiny_resolved

from megazoo.models.moe.router import route
from megazoo.models.presets import get_preset
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError


def _hand(logits, bias, k, nodes, m, scaling):
    """One token at a time, in Python: the report's node limit, then the top-k, weights normalised and scaled."""
    scores = torch.sigmoid(logits)
    biased = (scores + bias).tolist()
    per, size = math.ceil(k / m), logits.shape[1] // nodes
    out_idx, out_w = [], []
    for t, row in enumerate(biased):
        node_score = [sum(sorted(row[n * size:(n + 1) * size], reverse=True)[:per]) for n in range(nodes)]
        kept = sorted(range(nodes), key=lambda n: -node_score[n])[:m]
        allowed = [e for e in range(len(row)) if e // size in kept]
        chosen = sorted(allowed, key=lambda e: -row[e])[:k]
        w = scores[t, chosen]
        out_idx.append(chosen)
        out_w.append((w / w.sum() * scaling).tolist())
    return torch.tensor(out_idx), torch.tensor(out_w)


def test_route_equals_hand_reference():
    torch.manual_seed(0)
    logits, bias = torch.randn(64, 12), 0.3 * torch.randn(12)  # the router scores in fp32
    changed = 0
    for k, nodes, m in ((3, 4, 2), (4, 3, 1), (2, 6, 2), (5, 4, 3)):
        w, idx, _ = route(logits, k, "sigmoid_bias", True, bias=bias, scaling=2.5, nodes=nodes, max_nodes=m)
        want_idx, want_w = _hand(logits, bias, k, nodes, m, 2.5)
        assert torch.equal(idx, want_idx)
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)
        assert all(len({int(e) // (12 // nodes) for e in row}) <= m for row in idx)  # at most M nodes per token
        free = route(logits, k, "sigmoid_bias", True, bias=bias, scaling=2.5)[1]
        changed += int((free.sort(-1).values != idx.sort(-1).values).any(-1).sum())
    assert changed > 10  # the limit decides many tokens' experts here


def test_equals_transformers_group_limit_where_a_node_scores_its_two_best():
    """K = 8, M = 4 as DeepSeek-V3 (K / M = 2): the node limit is HF's n_group / topk_group on the same groups."""
    torch.manual_seed(1)
    logits, bias = torch.randn(32, 16), 0.2 * torch.randn(16)
    a = route(logits, 8, "sigmoid_bias", True, bias=bias, nodes=8, max_nodes=4)
    b = route(logits, 8, "sigmoid_bias", True, bias=bias, n_group=8, topk_group=4)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


MODEL = {"preset": "llama-tiny", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
         "vocab_size": 300, "n_experts": 8, "moe_top_k": 3, "moe_d_ff": 16, "moe_router": "sigmoid_bias",
         "moe_nodes": 2, "moe_max_nodes": 1, "moe_bias_update_rate": 0.01, "dropout": 0.0, "attn_dropout": 0.0}


def _res(parallel: dict, grad_accum: int, model: dict | None = None):
    return tiny_resolved(model={**MODEL, **(model or {})}, parallel=parallel, zero={"stage": 1},
                         train={"steps": 3, "micro_batch": 2, "grad_accum": grad_accum, "eval_batches": 1})


def test_ep2_over_two_nodes_equals_one_process():
    """node_size 1: each ep rank is a node and holds its node's 4 experts; each token reaches one of them."""
    ref = train_run(_res({}, 4), Topology.solo())
    res = _res({"dp": 2, "ep": 2, "node_size": 1}, 2)
    for got in run_distributed(lambda: train_run(res, Topology.of(res.recipe.parallel)), res.world_size):
        assert_same_training(got, ref)
    free = train_run(_res({}, 4, {"moe_nodes": 1, "moe_max_nodes": 0}), Topology.solo())
    assert abs(free["losses"][-1] - ref["losses"][-1]) > 1e-6  # the limit is on


def test_refusals():
    cfg = get_preset("llama-tiny").replace(n_experts=8, moe_top_k=2, moe_router="sigmoid_bias")
    for changes, words in (({"moe_nodes": 3, "moe_max_nodes": 1}, r"model.moe_nodes = 3 does not divide "
                            r"model.n_experts = 8; valid: \[1, 2, 4, 8\]"),
                           ({"moe_nodes": 2, "moe_max_nodes": 3}, r"model.moe_max_nodes = 3 is larger than "
                            "model.moe_nodes = 2; valid: 1..2"),
                           ({"moe_nodes": 2}, "model.moe_nodes = 2 without model.moe_max_nodes"),
                           ({"moe_nodes": 4, "moe_max_nodes": 1, "moe_top_k": 3}, "model.moe_top_k = 3 is more than "
                            "the 2 experts on model.moe_max_nodes = 1 nodes of 2; valid: 1..2"),
                           ({"moe_nodes": 4, "moe_max_nodes": 2, "moe_n_group": 4, "moe_topk_group": 2},
                            "one limit at a time"),
                           ({"moe_nodes": 2, "moe_max_nodes": 1, "moe_router": "softmax"},
                            "model.moe_nodes, model.moe_max_nodes set but model.moe_router = 'softmax'")):
        with pytest.raises(ValueError, match=words):
            cfg.replace(**changes)
    with pytest.raises(RecipeError, match=r"model.moe_nodes = 4 does not divide parallel.ep = 2: .*valid moe_nodes: "
                       r"\[1, 2\]"):
        _res({"dp": 2, "ep": 2}, 2, {"moe_nodes": 4, "moe_top_k": 2})
    # dp 2 x tp 2 at 2 processes per node: the two ep ranks (global ranks 0 and 2) sit on two nodes
    with pytest.raises(RecipeError, match=r"model.moe_nodes = 1 with parallel.ep = 2: a node group's 2 ep ranks span "
                       r"2 nodes at parallel.node_size = 2 \(tp = 2\)"):
        _res({"dp": 2, "tp": 2, "ep": 2, "node_size": 2}, 2, {"moe_nodes": 1})
    assert _res({"dp": 2, "tp": 2, "ep": 2, "node_size": 2}, 2).world_size == 4  # one ep rank per node: fine
