"""The Llama-style decoder (RMSNorm, rotary with llama3 scaling, SwiGLU, grouped-query attention, untied head,
qkv bias, sliding window) computes the same function at tp = 2 and 4 as in one process, in fp64 to 1e-10:
initial full weights (bit-identical), logits, loss and every gradient.

With 2 key/value heads, tp = 2 splits them (c_kv column-parallel) and tp = 4 replicates them (each rank projects
the head its query heads share; the weight gradient is all-reduced over tp in backward). A multi-head variant
(n_kv_head = n_head: GPT-2's fused c_attn) with a tied head runs the same checks.
"""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_distributed

from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import full_state_dict, init_weights
from megazoo.parallel.tensor import gather_from_tp_region, gather_full, named_shards
from megazoo.parallel.topology import Topology

V, SEED = 300, 11
GQA = get_preset("llama-tiny").replace(n_layer=2, vocab_size=V, d_model=64, n_head=4, n_kv_head=2, d_ff=96,
                                        n_positions=64, qkv_bias=True, sliding_window=8, rope_theta=500000.0,
                                        rope_scaling="llama3", rope_factor=8.0, rope_original_positions=16)
MHA = GQA.replace(n_kv_head=4, tie_embeddings=True, sliding_window=0, rope_scaling="none", qkv_bias=False)
CONFIGS = {"gqa": GQA, "mha": MHA}
TOL = 1e-10


def _batch():
    ids = torch.randint(0, V, (2, 21), generator=torch.Generator().manual_seed(0))
    ids[0, 0], ids[1, 1] = V - 1, 150  # ids in several vocabulary shards
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[1, 3] = -100
    return inputs, targets


IDS, TARGETS = _batch()


def _run(topo: Topology, which: str):
    cfg = CONFIGS[which]
    model = GPT(cfg, topo, dtype=torch.float64)
    init_weights(model, SEED)
    weights = full_state_dict(model)
    logits = model(IDS)
    loss = model.loss(logits, TARGETS)
    loss.backward()
    full_logits = gather_from_tp_region(logits.detach(), topo.tp_group)[..., :V]
    grads = {name: gather_full(p.grad, spec, topo.tp_group) for name, p, spec in named_shards(model)}
    for name in ("wte.weight", "lm_head.weight"):
        if name in grads:
            assert torch.all(grads[name][V:] == 0), f"padding rows of {name} get no gradient"
            grads[name] = grads[name][:V]
    return dict(weights=weights, logits=full_logits, loss=loss.detach(), grads=grads)


@functools.lru_cache(maxsize=None)
def solo(which: str):
    return _run(Topology.solo(), which)


@functools.lru_cache(maxsize=None)
def on_tp(tp: int, which: str):
    return run_distributed(lambda w: _run(Topology.build(dp=1, tp=tp), w), tp, which)


def max_dev(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("which", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_equals_one_process_fp64(tp, which):
    ref = solo(which)
    names = set(ref["grads"])
    if which == "gqa":
        assert "lm_head.weight" in names and "h.0.attn.c_kv.bias" in names and "wpe.weight" not in names
    else:
        assert "h.0.attn.c_attn.weight" in names and "lm_head.weight" not in names
    for out in on_tp(tp, which):
        for name, tensor in ref["weights"].items():
            assert torch.equal(out["weights"][name], tensor), f"initial {name} differs at tp={tp}"
        assert max_dev(out["logits"], ref["logits"]) < TOL
        assert abs(out["loss"].item() - ref["loss"].item()) < TOL
        assert out["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            assert grad.abs().max() > 0, name
            assert max_dev(out["grads"][name], grad) < TOL, f"grad of {name} at tp={tp}"


def test_sliding_window_and_rope_scaling_change_the_function():
    """The options are live: without the window, or without the llama3 scaling, the logits differ."""
    def logits(cfg):
        model = GPT(cfg, Topology.solo(), dtype=torch.float64)
        init_weights(model, SEED)
        return model(IDS)

    base = logits(GQA)
    assert max_dev(logits(GQA.replace(sliding_window=0)), base) > 1e-6
    assert max_dev(logits(GQA.replace(rope_scaling="none")), base) > 1e-6
    # positions before the window's first miss see the same keys: their logits agree
    assert max_dev(logits(GQA.replace(sliding_window=0))[:, :8], base[:, :8]) < 1e-12


def test_bad_gqa_layout_is_refused_with_the_field():
    cfg = GQA.replace(n_head=6, n_kv_head=3, d_model=48, d_ff=96)
    with pytest.raises(ValueError, match=r"parallel.tp = 2 neither divides nor is a multiple of the 3 key/value"):
        GPT(cfg, Topology(tp=2, tp_rank=0), device="meta")
    with pytest.raises(ValueError, match=r"model.n_kv_head = 5 does not divide model.n_head = 4"):
        GQA.replace(n_kv_head=5)
    with pytest.raises(ValueError, match=r"model.norm = 'batchnorm' is invalid; valid: 'layernorm', 'rmsnorm'"):
        GQA.replace(norm="batchnorm")
