"""The GPT model at tp = 1, 2, 4 computes the solo model's function: weights, logits, loss and gradients.

The reference is the single-process model (Topology.solo()) with the same init seed. Ranks return full tensors
(vocab shards all-gathered, parameters and gradients gathered with their ShardSpec via parallel.tensor.named_shards)
and the parent compares them.
"""

import functools

import pytest
import torch
from harness import run_distributed

from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import full_state_dict, init_weights
from megazoo.parallel.tensor import TPRNGTracker, gather_from_tp_region, gather_full, named_shards
from megazoo.parallel.tensor.random import seed_default_stream
from megazoo.parallel.topology import Topology

CFG = get_preset("gpt2-tiny").replace(vocab_size=300, dropout=0.0, attn_dropout=0.0, n_layer=2)
DROPOUT_CFG = CFG.replace(dropout=0.1, attn_dropout=0.1)
SEED, OTHER_SEED, DROPOUT_SEED = 7, 8, 123
V = CFG.vocab_size


def _batch():
    ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(0))
    ids[0, 0], ids[0, 1], ids[1, 2] = V - 1, 0, 150  # ids in every tp=4 shard that holds real rows (128 each)
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[1, 4] = -100  # an ignored position
    return inputs, targets


IDS, TARGETS = _batch()


def on_tp(tp, fn, *args):
    def body(*a):
        return fn(Topology.build(dp=1, tp=tp), *a)

    return run_distributed(body, tp, *args)


def rel_err(actual, expected):
    """max |actual - expected| relative to the largest |expected| (a scale-aware fp32 tolerance)."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def full_grads(model):
    grads = {name: gather_full(p.grad, spec, model.topo.tp_group) for name, p, spec in named_shards(model)}
    grads["wte.weight"], pad = grads["wte.weight"][:V], grads["wte.weight"][V:]
    assert torch.all(pad == 0), "padding rows of the embedding must get no gradient"
    return grads


def forward_backward(model):
    """(full unpadded logits, loss, full gradients) for the test batch."""
    logits = model(IDS)
    loss = model.loss(logits, TARGETS)
    loss.backward()
    full_logits = gather_from_tp_region(logits.detach(), model.topo.tp_group)
    assert full_logits.shape[-1] == CFG.padded_vocab(model.topo.tp)
    return full_logits[..., :V], loss.detach(), full_grads(model)


def _run_model(topo):
    """Full initial weights for SEED and OTHER_SEED, and the SEED model's full logits, loss and gradients."""
    model = GPT(CFG, topo)
    init_weights(model, SEED)
    weights = full_state_dict(model)
    padded_wte = gather_full(model.wte.weight, model.wte.shard_specs["weight"], topo.tp_group)
    assert padded_wte.shape[0] == CFG.padded_vocab(topo.tp)
    assert torch.all(padded_wte[V:] == 0), "padding rows of the embedding start at zero"
    logits, loss, grads = forward_backward(model)
    init_weights(model, OTHER_SEED)
    return dict(weights=weights, logits=logits, loss=loss, grads=grads, other=full_state_dict(model))


@functools.lru_cache(maxsize=None)
def solo_reference():
    return _run_model(Topology.solo())


@functools.lru_cache(maxsize=None)
def tp_results(tp):
    return on_tp(tp, _run_model)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_initial_full_weights_are_bit_identical_to_solo(tp):
    ref = solo_reference()
    for out in tp_results(tp):
        for key in ("weights", "other"):
            assert out[key].keys() == ref[key].keys()
            for name, tensor in ref[key].items():
                assert out[key][name].shape == tensor.shape, name
                assert torch.equal(out[key][name], tensor), f"{key} {name} differs from the solo model's at tp={tp}"


def test_another_seed_gives_other_weights():
    ref = solo_reference()
    for name, tensor in ref["weights"].items():
        constant = ".ln_" in name or name.startswith("ln_f") or name.endswith("bias")  # ones / zeros by design
        assert torch.equal(ref["other"][name], tensor) == constant, name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_logits_loss_and_gradients_match_solo(tp):
    ref = solo_reference()
    for rank, out in enumerate(tp_results(tp)):
        assert rel_err(out["logits"], ref["logits"]) < 1e-5
        torch.testing.assert_close(out["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["loss"], ref["loss"], rtol=1e-6, atol=0)
        assert out["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            assert grad.abs().max() > 0, name
            assert rel_err(out["grads"][name], grad) < 1e-5, f"grad of {name} at tp={tp} (rank {rank})"


# --- dropout under tensor parallelism -------------------------------------------------------------------------


def _dropout_run(topo, default_seed_per_rank):
    model = GPT(DROPOUT_CFG, topo, rng=TPRNGTracker(SEED, topo.tp_rank))
    init_weights(model, SEED)
    seed_default_stream(DROPOUT_SEED + (topo.tp_rank if default_seed_per_rank else 0))
    hidden = []  # the residual stream entering ln_f, per forward
    model.ln_f.register_forward_hook(lambda mod, inp, out: hidden.append(inp[0].detach().clone()))
    tp_stream_start = model.rng.get_state()
    model.train()
    loss = model.loss(model(IDS), TARGETS)
    loss.backward()
    tp_stream_after_train = model.rng.get_state()
    replicated = {name: p.grad.clone() for name, p, spec in named_shards(model) if spec.dim is None}
    model.eval()
    with torch.no_grad():
        eval_loss = model.loss(model(IDS), TARGETS)
    moved = (not torch.equal(tp_stream_start, tp_stream_after_train),
             not torch.equal(tp_stream_after_train, model.rng.get_state()))
    return dict(loss=loss.item(), eval_loss=eval_loss.item(), train_hidden=hidden[0], eval_hidden=hidden[1],
                grads=replicated, tp_stream_moved=moved)


def test_dropout_replicated_stream_is_identical_across_tp_ranks():
    out0, out1 = on_tp(2, _dropout_run, False)
    for out in (out0, out1):
        assert not torch.allclose(out["train_hidden"], out["eval_hidden"], rtol=1e-2, atol=1e-3), "dropout is off"
        assert out["loss"] != out["eval_loss"]
        # Attention dropout draws from the tensor-parallel stream (train mode only), not the replicated one.
        assert out["tp_stream_moved"] == (True, False)
    assert out0["loss"] == out1["loss"] and out0["eval_loss"] == out1["eval_loss"]
    # The residual stream (dropout from the default stream) is the same tensor on both ranks...
    assert torch.equal(out0["train_hidden"], out1["train_hidden"])
    # ...so every replicated parameter (LayerNorms, positions, row-parallel biases) gets the same gradient.
    assert out0["grads"].keys() == out1["grads"].keys() and len(out0["grads"]) > 0
    for name in out0["grads"]:
        torch.testing.assert_close(out0["grads"][name], out1["grads"][name], rtol=1e-6, atol=1e-9)


def test_dropout_with_differently_seeded_default_streams_diverges():
    """The control for the test above: the identity comes from the seeding, not from the all-reduces."""
    out0, out1 = on_tp(2, _dropout_run, True)
    assert not torch.allclose(out0["train_hidden"], out1["train_hidden"])


def _checkpointing_run(topo, checkpointing, replay=True):
    model = GPT(DROPOUT_CFG, topo, rng=TPRNGTracker(SEED, topo.tp_rank), activation_checkpointing=checkpointing)
    if not replay:  # the negative control: recompute without replaying the tensor-parallel stream
        model.rng.replayable = lambda fn: fn
    init_weights(model, SEED)
    seed_default_stream(DROPOUT_SEED)
    model.train()
    loss = model.loss(model(IDS), TARGETS)
    loss.backward()
    grads = {name: gather_full(p.grad, spec, topo.tp_group) for name, p, spec in named_shards(model)}
    # Where both streams stand afterwards: checkpointing must not move either of them.
    return loss.item(), grads, model.rng.get_state(), torch.rand(4)


def _compare_checkpointing(plain, ckpt):
    loss, grads, tp_state, next_default = plain
    ckpt_loss, ckpt_grads, ckpt_tp_state, ckpt_next_default = ckpt
    assert ckpt_loss == pytest.approx(loss, rel=1e-6, abs=0)
    assert ckpt_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert rel_err(ckpt_grads[name], grad) < 1e-6, name
    assert torch.equal(ckpt_tp_state, tp_state)
    assert torch.equal(ckpt_next_default, next_default)


def test_activation_checkpointing_with_dropout_matches_plain_solo():
    topo = Topology.solo()
    plain = _checkpointing_run(topo, False)
    _compare_checkpointing(plain, _checkpointing_run(topo, True))
    # Control: without replaying the tp stream the recomputed attention-dropout masks differ.
    _, broken_grads, _, _ = _checkpointing_run(topo, True, replay=False)
    assert max(rel_err(broken_grads[name], grad) for name, grad in plain[1].items()) > 1e-3


def test_activation_checkpointing_with_dropout_matches_plain_tp2():
    def work(topo):
        return _checkpointing_run(topo, False), _checkpointing_run(topo, True)

    for plain, ckpt in on_tp(2, work):
        _compare_checkpointing(plain, ckpt)


# --- bad input ------------------------------------------------------------------------------------------------


def test_tp_not_dividing_heads_is_a_clear_error():
    cfg = get_preset("tnlg-17b")
    with pytest.raises(ValueError) as err:
        GPT(cfg, Topology(tp=8, tp_rank=0), device="meta")  # shapes only: nothing is allocated
    message = str(err.value)
    assert "n_head = 28" in message and "parallel.tp = 8" in message and "tnlg-17b" in message
    assert "[1, 2, 4, 7, 14, 28]" in message


def test_sequence_longer_than_positions_is_a_clear_error():
    model = GPT(CFG, Topology.solo(), device="meta")
    with pytest.raises(ValueError, match="n_positions = 256"):
        model(torch.zeros(1, CFG.n_positions + 1, dtype=torch.long))
