"""RMSNorm (models/norms.py): HF LlamaRMSNorm's values, and a backward that keeps only x and 1/rms, equal to
plain autograd's gradients (fp64 gradcheck and against the unfused expression)."""

import torch

from megazoo.models.norms import RMSNorm


def plain(x, weight, eps):  # HF LlamaRMSNorm, through autograd
    stats = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * (stats * torch.rsqrt(stats.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_values_and_gradients_equal_autograd():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    norm = RMSNorm(16, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, dtype=torch.float64, generator=gen))
    assert torch.autograd.gradcheck(_apply, (x, norm.weight))
    grad = torch.randn(3, 5, 16, dtype=torch.float64, generator=gen)
    ours = norm(x)
    ref = plain(x, norm.weight, 1e-5)
    assert torch.equal(ours, ref)
    dx, dw = torch.autograd.grad(ours, (x, norm.weight), grad)
    rx, rw = torch.autograd.grad(ref, (x, norm.weight), grad)
    assert (dx - rx).abs().max() < 1e-12 and (dw - rw).abs().max() < 1e-12


def _apply(x, w):
    from megazoo.models.norms import _RMSNormFunction

    return _RMSNormFunction.apply(x, w, 1e-5)


def test_bf16_input_keeps_fp32_statistics():
    x = torch.randn(4, 32).bfloat16()
    norm = RMSNorm(32, eps=1e-6, dtype=torch.bfloat16)
    assert torch.equal(norm(x), plain(x, norm.weight, 1e-6))
