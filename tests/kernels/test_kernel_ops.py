"""Our Triton kernels as torch ops (torch.library.custom_op): schema, fake (shape-only) and autograd
implementations checked by torch.library.opcheck, shapes propagated on fake tensors without a kernel launch, and
a transformer block with every Triton kernel captured by torch.compile(fullgraph=True) as one graph.

On CPU Triton runs only interpreted (TRITON_INTERPRET=1, set below before the kernels are imported), so the
compiled block here runs with backend "aot_eager": Dynamo captures the graph and AOTAutograd derives the backward
through the ops' registered formulas, each Triton op one node that runs the interpreted kernel; Inductor cannot
generate a Triton kernel for CPU tensors. Numerical parity of each kernel with its reference is
tests/kernels/test_kernels.py's.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before kernels/triton_*.py are imported: Triton fixes the mode at @jit

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: pip install 'megazoo[kernels]'")


def _ops():
    from megazoo.kernels import triton_bias_gelu, triton_cross_entropy, triton_layer_norm, triton_softmax
    return triton_layer_norm, triton_bias_gelu, triton_softmax, triton_cross_entropy


def _cases():
    """(op, args) per op: small shapes, fp32, ragged last dims (padding columns inside a block)."""
    ln, bg, sm, ce = _ops()
    g = torch.Generator().manual_seed(0)
    r = lambda *s, grad=True: torch.randn(*s, generator=g).requires_grad_(grad)  # noqa: E731
    x = r(3, 5, 24)
    m, v = 6, 40
    target = torch.tensor([0, 7, -1, 39, 12, -1])
    lse = torch.randn(m, generator=g)
    scale = torch.rand(m, generator=g)
    return {
        "layer_norm_fwd": (ln.layer_norm_fwd, (x, r(24), r(24), 1e-5)),
        "layer_norm_bwd": (ln.layer_norm_bwd, (r(4, 24, grad=False), r(24, grad=False), r(4, grad=False),
                                               r(4, grad=False).abs(), r(4, 24, grad=False))),
        "bias_gelu_fwd": (bg.bias_gelu_fwd, (r(2, 3, 20), r(20))),
        "bias_gelu_bwd": (bg.bias_gelu_bwd, (r(6, 20, grad=False), r(20, grad=False), r(6, 20, grad=False))),
        "causal_softmax_fwd": (sm.causal_softmax_fwd, (r(2, 2, 9, 9), 0.3)),
        "causal_softmax_bwd": (sm.causal_softmax_bwd, (r(2, 9, 9, grad=False).softmax(-1), r(2, 9, 9, grad=False),
                                                       0.3)),
        "cross_entropy_stats": (ce.cross_entropy_stats, (r(m, v, grad=False), target, 37, 16)),
        "cross_entropy_grad": (ce.cross_entropy_grad, (r(m, v, grad=False), target, lse, scale, 37, 16)),
    }


OP_NAMES = ("layer_norm_fwd", "layer_norm_bwd", "bias_gelu_fwd", "bias_gelu_bwd", "causal_softmax_fwd",
            "causal_softmax_bwd", "cross_entropy_stats", "cross_entropy_grad")


@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(name):
    """torch.library.opcheck: the schema matches what the op does (no mutation, no aliasing), the fake
    implementation's outputs match the real ones' shapes, dtypes and strides, the autograd registration is used,
    and AOTAutograd traces the op (dynamic shapes included)."""
    op, args = _cases()[name]
    assert op._qualname == f"megazoo::{name}"
    torch.library.opcheck(op, args)


def test_every_triton_kernel_is_an_op():
    """No Triton kernel module keeps an autograd.Function around its launch (it would be opaque to fake tensors)."""
    for module in _ops():
        assert not [k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, torch.autograd.Function)]


def test_fake_tensors_propagate_shapes_and_gradients_without_a_launch():
    """On fake tensors (the dry run's, on any device) each op answers shape and dtype from its fake
    implementation, forward and backward; the interpreter would fail on a fake tensor's data pointer."""
    ln, bg, sm, ce = _ops()
    with FakeTensorMode():
        x = torch.empty(4, 16, 48, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(48, requires_grad=True)
        b = torch.empty(48, requires_grad=True)
        y = ln.layer_norm_triton(x, w.bfloat16(), b.bfloat16(), 1e-5)
        h = bg.bias_gelu_triton(y, b.bfloat16())
        p = sm.scaled_causal_softmax_triton(h.view(4, 16, 3, 16).transpose(1, 2)[..., :16, :16].contiguous(), 0.25)
        assert (y.shape, y.dtype, h.shape, p.shape, p.dtype) == ((4, 16, 48), torch.bfloat16, (4, 16, 48),
                                                                 (4, 3, 16, 16), torch.bfloat16)
        p.float().sum().backward()
        assert (x.grad.shape, x.grad.dtype, w.grad.shape, w.grad.dtype) == ((4, 16, 48), torch.bfloat16, (48,),
                                                                           torch.float32)
        stats = ce.cross_entropy_stats(torch.empty(64, 100, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.long),
                                       100, 0)
        assert (stats.shape, stats.dtype) == ((3, 64), torch.float32)
    with pytest.raises(TypeError, match="fp32/bf16/fp16"), FakeTensorMode():
        ln.layer_norm_triton(torch.empty(2, 8, dtype=torch.float64), torch.empty(8, dtype=torch.float64),
                             torch.empty(8, dtype=torch.float64), 1e-5)


def _triton_block():
    from megazoo.kernels import KernelChoice, resolve_kernels
    from megazoo.models.config import ModelConfig
    from megazoo.models.transformer import Block
    from megazoo.parallel.tensor import TPRNGTracker
    from megazoo.parallel.topology import Topology

    topo = Topology.solo()
    kernels = resolve_kernels(KernelChoice(prefer="triton", overrides={"attention": "triton"}), "cpu")
    assert {kernels[op].name for op in ("layer_norm", "bias_gelu", "attention")} == {"triton"}
    cfg = ModelConfig(name="t", n_layer=1, n_head=2, d_model=32, n_positions=32, vocab_size=64, dropout=0.0,
                      attn_dropout=0.0)
    torch.manual_seed(0)
    block = Block(cfg, topo, TPRNGTracker(0, 0, topo.device), kernels=kernels)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return block


def test_block_with_triton_kernels_compiles_as_one_graph():
    """torch._dynamo.explain: one graph, no graph break; fullgraph=True compile (aot_eager, see the module
    docstring) gives the eager block's output and input gradient bit for bit, with every Triton op in the graph."""
    block = _triton_block()
    x = torch.randn(2, 16, 32, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    targets = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"megazoo.layer_norm_fwd.default", "megazoo.bias_gelu_fwd.default",
            "megazoo.causal_softmax_fwd.default"} <= targets, targets

    eager = block(x)
    eager.sum().backward()
    eager_grad, x.grad = x.grad, None
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
    compiled.sum().backward()
    assert torch.equal(compiled, eager) and torch.equal(x.grad, eager_grad)
