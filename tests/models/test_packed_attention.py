"""Packed rows' attention without an (s x s) mask (models/packing.py): the variable-length path equals the
dense block-diagonal mask it replaced (fp64, forward and gradients, with padding and a sliding window), a packed
model's forward + backward creates no tensor of s x s elements (the dense mask alone was b x s x s), and on CUDA
torch's variable-length FlashAttention gives the dense mask's result (tests marked cuda)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megazoo.models.packing import Segments
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology

IDS = torch.tensor([[1] * 5 + [2] * 9 + [3] * 3 + [0] * 3,  # three examples and padding
                    [1] * 12 + [2] * 8,
                    [1] * 20])  # one example filling the row


@pytest.mark.parametrize("window", [0, 4])
def test_varlen_attention_equals_the_dense_mask(window):
    seg = Segments.from_ids(IDS, window)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 20, 8, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3))
    got = seg.attend(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.dense_mask())
    # equal up to the order of the reductions (measured: at most 2e-15)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    grad = torch.randn(got.shape, dtype=torch.float64, generator=gen)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    assert seg.max_len == 20 and seg.cu_seqlens.tolist() == [0, 5, 14, 17, 20, 32, 40, 60]


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation produced while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


@pytest.mark.parametrize("window", [0, 100])  # 100: shorter than three of the four examples
def test_a_packed_forward_and_backward_make_no_s_by_s_tensor(window):
    s = 512  # s x s = 262,144 elements; the largest other tensor is the MLP's [gate; up], 2 x 512 x 128
    cfg = dataclasses.replace(get_preset("llama-tiny"), n_layer=1, n_head=4, n_kv_head=2, d_model=32, d_ff=64,
                              n_positions=s, vocab_size=96, dropout=0.0, attn_dropout=0.0, sliding_window=window)
    model = GPT(cfg, Topology.solo(), dtype=torch.float32)
    init_weights(model, 0)
    tokens = torch.randint(1, 96, (2, s), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([torch.full((2, n), i + 1) for i, n in enumerate((120, 180, 140, 72))], dim=1)
    with _LargestTensor() as watch:
        model(tokens, segment_ids=ids).float().logsumexp(-1).sum().backward()
    assert watch.largest < s * s, watch.largest
    with _LargestTensor() as watch:  # what the attention took before: the dense mask, b x s x s
        Segments.from_ids(ids, window).dense_mask()
    assert watch.largest >= 2 * s * s


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 4])
def test_cuda_varlen_flash_attention_equals_the_dense_mask(dtype, window):
    """One call of torch's variable-length FlashAttention over every run; the reference is the dense mask in
    fp32 on the same rounded inputs. Bound, per element: FlashAttention rounds the probabilities to `dtype`
    before P V (at most eps/2 each: eps/2 x (P |V|)) and rounds the output (eps/2 |y|); held with a factor 2."""
    seg = Segments.from_ids(IDS.cuda(), window)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(3, 4, 20, 64, device="cuda", generator=gen).to(dtype) for _ in range(3))
    got = seg.attend(q, k, v)
    q32, k32, v32 = q.float(), k.float(), v.float()
    mask = seg.dense_mask()
    want = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
    probs = (q32 @ k32.transpose(-1, -2) / 8.0).masked_fill(~mask, float("-inf")).softmax(-1)
    eps = torch.finfo(dtype).eps
    bound = eps * (probs @ v32.abs()) + eps * want.abs()
    assert ((got.float() - want).abs() <= bound).all()
    # the window is the dense mask's (query i sees i - window + 1 .. i): off by one key, the bound fails
    if window:
        wider = Segments.from_ids(IDS.cuda(), window + 1).attend(q, k, v)
        assert ((wider.float() - want).abs() > bound).any()


def test_compiled_blocks_take_every_packing_without_recompiling():
    """train.compile = "blocks" with packed rows: the runs differ per micro-batch, the attention stays out of the
    graph, so the block compiles once (a recompilation raises here) and equals the eager model, with gradients."""
    import torch._dynamo

    from megazoo.recipes.training.model_setup import compile_blocks

    cfg = dataclasses.replace(get_preset("llama-tiny"), n_layer=1, n_head=4, n_kv_head=2, d_model=32, d_ff=64,
                              n_positions=64, vocab_size=96, dropout=0.0, attn_dropout=0.0)
    model, eager = (GPT(cfg, Topology.solo(), dtype=torch.float64) for _ in range(2))
    init_weights(model, 0)
    eager.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compile_blocks([model], "blocks:aot_eager")
    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lengths in [(10, 22, 32), (5, 5, 40, 14)]:
            ids = torch.cat([torch.full((2, n), i + 1) for i, n in enumerate(lengths)], dim=1)
            x = torch.randint(0, 96, (2, 64), generator=gen)
            for m in (model, eager):
                m.zero_grad()
                m(x, segment_ids=ids).sum().backward()
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
    torch._dynamo.reset()
