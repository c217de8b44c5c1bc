"""The zero-bubble backward split (parallel/pipeline/split_backward.py) is exact: B (input gradient) then W
(weight gradients) give the unsplit backward's gradients in fp64 to 1e-10, for every layer type, with tp 2 and
with activation checkpointing; B touches no parameter gradient and the gradient hooks (ZeRO's reductions) fire
in W, once per parameter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import run_distributed

from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.pipeline.split_backward import backward_input, backward_weight
from megazoo.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megazoo.parallel.topology import Topology
from megazoo.kernels import LayerNorm

CFG = dataclasses.replace(get_preset("gpt2-tiny"), n_layer=4, d_model=32, n_head=4, d_ff=64, vocab_size=200,
                          n_positions=64, dropout=0.0, attn_dropout=0.0)
F64 = torch.float64


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}


def _compare(module: torch.nn.Module, make_input, make_root, loss: bool = False, recomputing: bool = False) -> int:
    """Unsplit backward vs B then W on the same module and inputs; returns how many gradients were compared.
    `loss`: make_root computes the loss from the module's output (the last stage), which B reads."""
    x = make_input()
    module.zero_grad(set_to_none=True)
    root, grad = make_root(module(x))
    torch.autograd.backward(root, grad)
    want_dx = None if not x.requires_grad else x.grad.clone()
    want = _grads(module)

    module.zero_grad(set_to_none=True)
    x = make_input()
    out = module(x)
    root, grad = make_root(out)
    dx, pending = backward_input(root, grad, x if x.requires_grad else None, out if loss else None, recomputing)
    if x.requires_grad and not recomputing:
        assert pending.root is None, "B kept the graph: the store should hold what W needs"
        assert pending.matmuls or not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                                          for m in module.modules()), "no linear's dW was deferred"
    assert all(p.grad is None for p in module.parameters()), "B accumulated a weight gradient"
    if want_dx is not None:
        torch.testing.assert_close(dx, want_dx, rtol=0, atol=1e-10)
    backward_weight(pending, list(module.parameters()))
    got = _grads(module)
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10, msg=name)
    return sum(g is not None for g in want.values()) + (want_dx is not None)


def _activation(shape, seed=0):
    def make():
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(True)
    return make


def _ids(seed=1):
    def make():
        return torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    return make


def _output_grad(out: torch.Tensor):
    g = torch.Generator().manual_seed(5)
    return out, torch.randn(out.shape, generator=g, dtype=out.dtype)


def _loss(model: GPT):
    targets = _ids(seed=3)()
    return lambda logits: (model.loss(logits, targets) * 0.25, None)


def _layer(kind: str, group=None) -> torch.nn.Module:
    torch.manual_seed(0)
    tp = 1 if group is None else torch.distributed.get_world_size(group)
    if kind == "column":
        layer = ColumnParallelLinear(32, 64, group, sections=1, dtype=F64)
    elif kind == "row":
        layer = RowParallelLinear(64, 32, group, dtype=F64)
    elif kind == "embedding":
        layer = VocabParallelEmbedding(256 * tp, 32, group, dtype=F64)
    else:
        layer = LayerNorm(32, dtype=F64)
    for p in layer.parameters():
        with torch.no_grad():
            p.normal_(0.0, 0.5)
    return layer


@pytest.mark.parametrize("kind", ["column", "row", "embedding", "layer_norm"])
def test_every_layer_type_splits_exactly(kind):
    layer = _layer(kind)
    make = {"column": _activation((2, 16, 32)), "row": _activation((2, 16, 64)),
            "embedding": _ids(), "layer_norm": _activation((2, 16, 32))}[kind]
    assert _compare(layer, make, _output_grad) >= 1


def _stage(topo: Topology, *, first: bool, last: bool, checkpointing: bool = False) -> GPT:
    layers = range(0, 2) if first else (range(2, 4) if last else range(1, 3))
    model = GPT(CFG, topo, layers=layers, with_embedding=first, with_head=last, dtype=F64,
                activation_checkpointing=checkpointing)
    init_weights(model, seed=11)
    return model.train()


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("first, last", [(True, False), (False, False), (False, True), (True, True)],
                         ids=["first-stage", "middle-stage", "last-stage-head", "whole-model-tied-head"])
def test_gpt_stages_split_exactly(first, last, checkpointing):
    model = _stage(Topology.solo(), first=first, last=last, checkpointing=checkpointing)
    make = _ids() if first else _activation((2, 16, CFG.d_model))
    assert _compare(model, make, _loss(model) if last else _output_grad, loss=last, recomputing=checkpointing) > 10


def test_hooks_fire_in_w_once_per_parameter():
    """ZeRO's gradient hooks (post-accumulate) see nothing during B and every parameter once during W."""
    model = _stage(Topology.solo(), first=False, last=False)
    fired: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.append(name))
    x = _activation((2, 16, CFG.d_model))()
    root, grad = _output_grad(model(x))
    _, pending = backward_input(root, grad, x)
    assert fired == []
    backward_weight(pending, list(model.parameters()))
    assert sorted(fired) == sorted(name for name, _ in model.named_parameters())
    assert not pending.groups  # the store is empty after W


def test_w_runs_only_the_weight_gradient_flops():
    """B + W do exactly the unsplit backward's matmul FLOPs (W recomputes no activation gradient), and W is the
    weight-gradient half: each linear's dW costs its forward's FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _stage(Topology.solo(), first=False, last=False)
    x = _activation((2, 16, CFG.d_model))()
    with FlopCounterMode(display=False) as forward:
        root, grad = _output_grad(model(x))
    with FlopCounterMode(display=False) as unsplit:
        torch.autograd.backward(root, grad, retain_graph=True)
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as b:
        _, pending = backward_input(root, grad, x)
    with FlopCounterMode(display=False) as w:
        backward_weight(pending, list(model.parameters()))
    assert b.get_total_flops() + w.get_total_flops() == unsplit.get_total_flops()
    linear_forward = sum(n for op, n in forward.get_flop_counts()["Global"].items() if "mm" in str(op)
                         and "bmm" not in str(op))
    assert w.get_total_flops() == linear_forward  # dW = dY^T X per linear: the forward matmul's FLOPs


def _tp_work(checkpointing: bool):
    topo = Topology.build(dp=1, tp=2)
    counts = []
    for kind, make in (("column", _activation((2, 16, 32))), ("row", _activation((2, 16, 32))),
                       ("embedding", _ids())):
        layer = _layer(kind, topo.tp_group)
        counts.append(_compare(layer, make, _output_grad))
    for first, last in ((True, False), (False, False), (False, True)):
        model = _stage(topo, first=first, last=last, checkpointing=checkpointing)
        make = _ids() if first else _activation((2, 16, CFG.d_model))
        counts.append(_compare(model, make, _loss(model) if last else _output_grad, loss=last,
                               recomputing=checkpointing))
    torch.distributed.barrier()
    return counts


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tensor_parallel_stages_split_exactly(checkpointing):
    results = run_distributed(_tp_work, 2, checkpointing)
    assert len(results) == 2 and all(min(counts) >= 1 for counts in results)


def _sequence_parallel_work():
    """Sequence parallelism: QKV and fc1 gather their input inside their own backward (eager edges, their weight
    gradients computed in B), the row-parallel projections are stashed, the norms' gradients all-reduced in W."""
    topo = Topology.build(dp=1, tp=2, sequence_parallel=True)
    counts = []
    for first, last in ((False, False), (False, True)):
        model = _stage(topo, first=first, last=last)
        counts.append(_compare(model, _activation((2, 8, CFG.d_model)), _loss(model) if last else _output_grad,
                               loss=last))
    torch.distributed.barrier()
    return counts


def test_sequence_parallel_stages_split_exactly():
    results = run_distributed(_sequence_parallel_work, 2)
    assert len(results) == 2 and all(min(counts) > 10 for counts in results)


@pytest.mark.parametrize("last", [False, True], ids=["middle-stage", "last-stage-head"])
def test_b_releases_the_graph_and_the_store_holds_each_linears_x_and_dy(last):
    """After B nothing the forward saved is alive but what the store keeps: per linear its input X and output
    gradient dY (tokens x in, tokens x out), the norms' and biases' gradients (parameter-shaped); on the last
    stage the head's X and d logits. The whole graph's saved activations are gone."""
    import gc
    import weakref

    model = _stage(Topology.solo(), first=False, last=last)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        saved.append(weakref.ref(t))
        return t

    x = _activation((2, 16, CFG.d_model))()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    root, grad = (_loss(model) if last else _output_grad)(out)
    graph_bytes = sum(t.untyped_storage().nbytes() for t in {r().untyped_storage().data_ptr(): r() for r in saved
                      if r() is not None and r().untyped_storage().data_ptr() not in params}.values())
    _, pending = backward_input(root, grad, x, out if last else None)
    del out, root, grad
    gc.collect()
    kept = {t.untyped_storage().data_ptr() for t in pending.held_tensors()} | params | {x.untyped_storage().data_ptr()}
    alive = [r() for r in saved if r() is not None]
    assert all(t.untyped_storage().data_ptr() in kept for t in alive), "B left graph tensors alive"
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    tokens = 2 * 16
    want = {(tokens * m.weight.shape[1], tokens * m.weight.shape[0]) for m in linears}
    assert {(m.x.numel(), m.dy.numel()) for m in pending.matmuls} == want
    assert len(pending.matmuls) == len(linears)
    # norm weights and biases: parameter-shaped; the tied head's weight gradient (d x V: W^T's), computed in B
    # because it is smaller than its x and d logits (tokens x (d + V)): no d logits wait for W
    assert sorted(g.dim() for g in pending.grads) == [1] * (len(pending.grads) - last) + [2] * last
    if last:
        assert [g.shape for g in pending.grads if g.dim() == 2] == [(CFG.d_model, model.vocab_padded)]
    store = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t
                                                       for t in pending.held_tensors()}.values())
    d_outputs = sum(m.dy.numel() * m.dy.element_size() for m in pending.matmuls)
    assert store < graph_bytes + d_outputs, (store, graph_bytes)  # what keeping the graph held (and more)


@pytest.mark.parametrize("last", [False, True], ids=["middle-stage", "last-stage-head"])
def test_bf16_autocast_split_equals_unsplit(last):
    """Under autocast the stashed matmuls read 16-bit casts of the weights: W's gradient flows back through the
    cast into the fp32 parameter, and B + W give the unsplit backward's gradients bit for bit."""
    model = GPT(CFG, Topology.solo(), layers=range(2, 4), with_embedding=False, with_head=last)
    init_weights(model, seed=11)
    model.train()
    targets = _ids(seed=3)()

    def run(split: bool):
        model.zero_grad(set_to_none=True)
        x = _activation((2, 16, CFG.d_model))().float().detach().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x)
            root = model.loss(out, targets) if last else out
        grad = None if last else torch.ones_like(out)
        if not split:
            torch.autograd.backward(root, grad)
            return x.grad, _grads(model)
        dx, pending = backward_input(root, grad, x, out if last else None)
        assert pending.root is None and pending.matmuls
        backward_weight(pending, list(model.parameters()))
        return dx, _grads(model)

    (want_dx, want), (got_dx, got) = run(False), run(True)
    assert torch.equal(got_dx, want_dx)
    for name in want:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
