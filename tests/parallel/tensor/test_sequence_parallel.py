"""Sequence parallelism (parallel/tensor/sequence.py) computes exactly what plain tensor parallelism and one process
compute, fp64 to 1e-10: logits, loss and every gradient of GPT-2 (LayerNorm, learned positions, biases, tied head)
and the Llama-style decoder (RMSNorm, rotary, SwiGLU, GQA split at tp 2 and replicated at tp 4, untied head); and
the real Trainer over 10 steps in layouts that combine it with pipeline, ZeRO, context parallelism and activation
checkpointing. Each run also checks that it is on: a block's input holds s / tp positions.
"""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_resolved
from parity_helpers import assert_same_training, train_run

from megazoo.models.generation.generate import decode
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.tensor import SequenceParallel, gather_from_tp_region, gather_full, named_shards
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.training.trainer import Trainer

V, SEED, TOL = 300, 5, 1e-10
LLAMA = get_preset("llama-tiny").replace(n_layer=2, vocab_size=V, d_model=64, n_head=4, n_kv_head=2, d_ff=96,
                                         n_positions=64, qkv_bias=True)
GPT2 = get_preset("gpt2-tiny").replace(n_layer=2, vocab_size=V, d_model=64, n_head=4, n_positions=64, dropout=0.0,
                                       attn_dropout=0.0)
CONFIGS = {"gpt2": GPT2, "llama": LLAMA}
IDS = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
TARGETS = torch.roll(IDS, -1, 1)


def _run(topo: Topology, which: str, batch: int = 2):
    model = GPT(CONFIGS[which], topo, dtype=torch.float64)
    init_weights(model, SEED)
    seen, own = [], []
    model.h["1"].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    # The embedding's shard is a copy: at b = 1 a view of the (1, s, d) output would hold all of it.
    model.h["0"].register_forward_pre_hook(
        lambda m, args: own.append(args[0].untyped_storage().nbytes() == args[0].numel() * args[0].element_size()))
    logits = model(IDS[:batch])
    loss = model.loss(logits, TARGETS[:batch])
    loss.backward()
    grads = {name: gather_full(p.grad, spec, topo.tp_group) for name, p, spec in named_shards(model)}
    for name in ("wte.weight", "lm_head.weight"):
        if name in grads:
            grads[name] = grads[name][:V]
    logits = gather_from_tp_region(logits.detach(), topo.tp_group)[..., :V]
    model.eval()  # KV-cache decoding runs plain tp (one new token cannot be split over tp), then sp is back on
    tokens = decode(model, IDS[0, :5].tolist(), 4)
    assert model.sequence_parallel.enabled == topo.sequence_parallel
    return dict(logits=logits, loss=loss.detach(), grads=grads, block_input_len=seen[0], tokens=tokens,
                own_storage=own[0])


@functools.cache
def solo(which: str, batch: int = 2):
    return _run(Topology.solo(), which, batch)


# batch 1: the gathers and reduce-scatters take their no-copy path ((1, s, d) is already laid out by rank)
@pytest.mark.parametrize("which, tp, batch", [("gpt2", 2, 2), ("llama", 2, 2), ("llama", 4, 2), ("llama", 2, 1)],
                         ids=["gpt2-tp2", "llama-tp2-kv-split", "llama-tp4-kv-replicated", "llama-tp2-batch1"])
def test_sequence_parallel_equals_one_process_fp64(which, tp, batch):
    ref = solo(which, batch)
    outs = run_distributed(lambda w: _run(Topology.build(dp=1, tp=tp, sequence_parallel=True), w, batch), tp,
                           which)
    for out in outs:
        assert out["block_input_len"] == IDS.shape[1] // tp  # the residual stream is split: it is on
        assert out["own_storage"]  # the first block's input is its s / tp positions' own storage
        assert (out["logits"] - ref["logits"]).abs().max() < TOL
        assert out["tokens"] == ref["tokens"]
        assert abs(out["loss"] - ref["loss"]) < TOL
        assert out["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():  # norms and row-parallel biases: partial grads all-reduced
            assert grad.abs().max() > 0, name
            assert (out["grads"][name] - grad).abs().max() < TOL, f"grad of {name} at tp {tp}"


def _bf16_autocast(topo: Topology):
    """fp32 parameters under bf16 autocast (megazoo's ZeRO-0 mixed precision): loss and gradients."""
    model = GPT(LLAMA, topo)
    init_weights(model, SEED)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(model(IDS), TARGETS)
    loss.backward()
    return loss.item(), {name: gather_full(p.grad, spec, topo.tp_group) for name, p, spec in named_shards(model)}


def test_under_bf16_autocast_it_matches_plain_tp():
    """The gathered projections (_GatheredLinears) cast to autocast's dtype as F.linear does and return fp32
    gradients: the same loss and gradients as plain tp to bf16 rounding (the sums run in another order)."""
    plain = run_distributed(lambda: _bf16_autocast(Topology.build(dp=1, tp=2)), 2)[0]
    sp = run_distributed(lambda: _bf16_autocast(Topology.build(dp=1, tp=2, sequence_parallel=True)), 2)[0]
    assert abs(sp[0] - plain[0]) < 1e-2 * abs(plain[0])
    for name, grad in plain[1].items():
        assert sp[1][name].dtype == torch.float32
        assert (sp[1][name] - grad).norm() <= 2e-2 * grad.norm(), name


def test_decoding_suspends_it_and_restores_it():
    sp = SequenceParallel(None, enabled=False)
    with sp.suspended():
        assert not sp.active
    assert sp.enabled is False
    with pytest.raises(ValueError, match="2 or more"):
        SequenceParallel(None, enabled=True)


# The real Trainer: LLAMA-sized tiny recipe (test_llama_train_parity's), 10 fp64 steps with warmup and clipping.
MODEL = {"preset": "llama-tiny", "n_layer": 4, "vocab_size": 300, "d_model": 64, "n_head": 4, "n_kv_head": 2,
         "d_ff": 96, "qkv_bias": True}
GPT_MODEL = {"preset": "gpt2-tiny", "n_layer": 4, "vocab_size": 300, "d_model": 64, "n_head": 4}


@functools.cache
def reference(model: str):
    return train_run(tiny_resolved(model=MODEL if model == "llama" else GPT_MODEL, train={"micro_batch": 8}),
                  Topology.solo())


@pytest.mark.parametrize("model, parallel, train, zero", [
    ("llama", {"tp": 2}, {"micro_batch": 8, "activation_checkpointing": True}, None),
    ("gpt2", {"tp": 2, "pp": 2, "schedule": "1f1b"}, {"micro_batch": 2, "grad_accum": 4}, None),
    ("llama", {"dp": 2, "tp": 2}, {"micro_batch": 4}, {"stage": 3}),
    ("llama", {"tp": 2, "cp": 2, "cp_attention": "ring"}, {"micro_batch": 8}, None),
    ("llama", {"tp": 2, "pp": 2, "schedule": "1f1b"}, {"micro_batch": 1, "grad_accum": 8,
                                                       "activation_checkpointing": True}, {"stage": 2}),
], ids=["llama-tp2-checkpointing", "gpt2-tp2-pp2", "llama-dp2-tp2-zero3", "llama-tp2-cp2-ring",
        "llama-tp2-pp2-micro-batch1-zero2"])
def test_trainer_with_sequence_parallel_equals_one_process(model, parallel, train, zero):
    res = tiny_resolved(model=MODEL if model == "llama" else GPT_MODEL,
                        parallel=dict(parallel, sequence_parallel=True), train=train, zero=zero or {})

    def work():
        trainer = Trainer(res, Topology.of(res.recipe.parallel))
        assert trainer.topo.sequence_parallel
        result = trainer.fit()
        return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                "params": trainer.full_state_dict()}

    for got in run_distributed(work, res.world_size):
        assert_same_training(got, reference(model))


def test_bad_layouts_are_refused_with_the_field():
    with pytest.raises(RecipeError, match="parallel.tp >= 2"):
        tiny_resolved(model=MODEL, parallel={"sequence_parallel": True})
    with pytest.raises(RecipeError, match="multiple of cp x tp"):
        tiny_resolved(model=MODEL, parallel={"tp": 4, "sequence_parallel": True}, train={"seq_len": 30})
    with pytest.raises(ValueError, match="tp >= 2"):
        Topology.build(1, 1, sequence_parallel=True)
