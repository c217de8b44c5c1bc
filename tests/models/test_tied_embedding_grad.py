"""The tied embedding's gradient: the lookup's rows are added into the head's weight gradient in place.

A GPT holding both the embedding and the head (pp = 1) keeps one dense vocabulary x dim gradient for the tied
weight in backward instead of three (the head's, the lookup's mostly-zero one, and their sum):
parallel/tensor/layers.py's _HeadKeepingGradient and _RowsLookup. Compared in fp64 with the plain F.linear +
F.embedding path (tp = 2 is covered by the model-parallel parity tests, which build the same GPT).
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology

CFG = get_preset("gpt2-tiny").replace(n_layer=2, vocab_size=1000, dropout=0.0, attn_dropout=0.0)


def _model(tied_head: bool, dtype=torch.float64) -> GPT:
    model = GPT(CFG, Topology.solo(), dtype=dtype)
    init_weights(model, seed=0)
    model.wte.tied_head = tied_head
    return model


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (2, 17), generator=gen)
    return ids[:, :-1], ids[:, 1:]


class _DenseWeightGradients(TorchDispatchMode):
    """Counts the distinct tensors of the tied weight's shape that backward's operations create."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.storages = shape, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.shape == self.shape and out.layout == torch.strided:
            self.storages.add(out.untyped_storage().data_ptr())
        return out


def _grads_and_dense_count(tied_head: bool, dtype=torch.float64, autocast: bool = False):
    model, (x, y) = _model(tied_head, dtype), _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model.loss(model(x), y)
    counter = _DenseWeightGradients(model.wte.weight.shape)
    with counter:
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, len(counter.storages)


def test_tied_gradient_equals_plain_autograd():
    fused, _ = _grads_and_dense_count(True)
    plain, _ = _grads_and_dense_count(False)
    assert fused.keys() == plain.keys()
    for name, ref in plain.items():
        torch.testing.assert_close(fused[name], ref, rtol=1e-12, atol=1e-14, msg=name)


def test_one_dense_gradient_for_the_tied_weight():
    _, fused = _grads_and_dense_count(True)
    _, plain = _grads_and_dense_count(False)
    assert fused == 1  # the head's weight gradient, into which the lookup's rows were added
    assert plain >= 2  # autograd's: the head's and the lookup's dense one (and their sum)


def test_autocast_keeps_the_plain_path():
    """Under autocast the head reads a bf16 cast of the weight: the gradient flows back through the cast."""
    fused, _ = _grads_and_dense_count(True, torch.float32, autocast=True)
    plain, _ = _grads_and_dense_count(False, torch.float32, autocast=True)
    for name, ref in plain.items():
        torch.testing.assert_close(fused[name], ref, rtol=0, atol=0, msg=name)


def test_only_a_module_with_both_uses_fuses():
    """A pipeline's first stage holds the lookup without the head and its last stage the head alone."""
    first = GPT(CFG, Topology.solo(), layers=range(0, 1), with_head=False)
    last = GPT(CFG, Topology.solo(), layers=range(1, 2), with_embedding=False)
    assert not first.wte.tied_head and not last.wte.tied_head
    assert GPT(CFG, Topology.solo()).wte.tied_head


def test_evaluation_and_decoding_need_no_gradient_state():
    model, (x, _) = _model(True), _batch()
    with torch.no_grad():
        logits = model(x)
    assert model.wte._shared is None and logits.shape == (*x.shape, model.vocab_padded)
