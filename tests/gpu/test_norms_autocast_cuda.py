"""The norms under CUDA autocast with a 16-bit input, on a real GPU (kernels/layer_norm.py
layer_norm_outside_autocast, models/norms.py): CUDA autocast lists layer_norm among its fp32 ops, so without the
fix y, dx and the input kept for backward were fp32. Held here: y and dx in the input's dtype, the weight's
gradient in the parameter's dtype, nothing of the input's shape kept in fp32 (LayerNorm: x, weight, bias, fp32
mean and 1/std only), and the numerics of every LayerNorm implementation the dispatch can run here (torch's with
its parameters cast to x's dtype as CUDA's kernel reads them, apex, Triton) and of RMSNorm against an fp64
reference on the same GPU, within tests/gpu/test_kernels_cuda.py's tolerances (scale-aware: bf16 2e-2, fp16 4e-3);
a GPT-2 and a Llama block stored in 16 bit, forward and backward, against their fp64 copies.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megazoo.kernels import KernelChoice, KernelError, LayerNorm, implementations, resolve_kernels
from megazoo.models.norms import RMSNorm
from megazoo.models.presets import get_preset
from megazoo.models.transformer import Block
from megazoo.parallel.tensor.random import TPRNGTracker
from megazoo.parallel.topology import Topology
from norm_helpers import assert_block_matches_fp64, close

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda", 0)
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
D = 1600  # gpt2-1.5b's width


def randn(*shape, seed, scale=1.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float64)


def layer_norm_fn(impl):
    try:
        return resolve_kernels(KernelChoice(overrides={"layer_norm": impl}), DEVICE)["layer_norm"].fn
    except KernelError as err:
        pytest.skip(str(err).splitlines()[0])


def run_saving(module, x, dy, dtype):
    """module(x) under CUDA autocast and its backward; the tensors autograd kept (dtype, shape)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                  lambda t: t):
        with torch.autocast("cuda", dtype=dtype):
            y = module(x)
    y.backward(dy)
    return y, saved


@pytest.mark.parametrize("impl", [i for i in implementations("layer_norm") if i != "reference"])
@pytest.mark.parametrize("params", ["fp32", "half"])
@pytest.mark.parametrize("half", list(HALF))
def test_layer_norm_under_cuda_autocast(impl, params, half):
    dt = HALF[half]
    pdt = torch.float32 if params == "fp32" else dt
    norm = LayerNorm(D, fn=layer_norm_fn(impl), device=DEVICE, dtype=pdt)
    with torch.no_grad():
        norm.weight.copy_(1 + randn(D, seed=2, scale=0.3))
        norm.bias.copy_(randn(D, seed=3))
    x = (randn(2, 128, D, seed=1, scale=3.0) + 0.5).to(dt).requires_grad_()
    dy = randn(2, 128, D, seed=4).to(dt)
    y, saved = run_saving(norm, x, dy, dt)
    assert y.dtype == x.grad.dtype == dt, (impl, y.dtype, x.grad.dtype)
    assert norm.weight.grad.dtype == norm.bias.grad.dtype == pdt
    assert not [s for s in saved if s == (torch.float32, tuple(x.shape))], saved  # no fp32 copy of x
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, norm.weight, norm.bias))
    yr = F.layer_norm(xr, (D,), wr, br, 1e-5)
    yr.backward(dy.double())
    for what, got, ref in (("y", y, yr.detach()), ("dx", x.grad, xr.grad), ("dweight", norm.weight.grad, wr.grad),
                           ("dbias", norm.bias.grad, br.grad)):
        close(got, ref, TOL[dt], f"{impl} {params} {half} {what}")


@pytest.mark.parametrize("params", ["fp32", "half"])
@pytest.mark.parametrize("half", list(HALF))
def test_rmsnorm_under_cuda_autocast(params, half):
    dt = HALF[half]
    pdt = torch.float32 if params == "fp32" else dt
    norm = RMSNorm(D, eps=1e-6, device=DEVICE, dtype=pdt)
    with torch.no_grad():
        norm.weight.copy_(1 + randn(D, seed=6, scale=0.3))
    x = randn(2, 128, D, seed=5, scale=2.0).to(dt).requires_grad_()
    dy = randn(2, 128, D, seed=7).to(dt)
    y, saved = run_saving(norm, x, dy, dt)
    assert y.dtype == x.grad.dtype == dt and norm.weight.grad.dtype == pdt
    assert not [s for s in saved if s == (torch.float32, tuple(x.shape))], saved
    xr, wr = (t.detach().double().requires_grad_() for t in (x, norm.weight))
    yr = wr * xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6)
    yr.backward(dy.double())
    for what, got, ref in (("y", y, yr.detach()), ("dx", x.grad, xr.grad), ("dweight", norm.weight.grad, wr.grad)):
        close(got, ref, TOL[dt], f"rmsnorm {params} {half} {what}")


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("half", list(HALF))
def test_block_in_16_bit_under_cuda_autocast_matches_fp64(preset, half):
    dt = HALF[half]
    cfg = dataclasses.replace(get_preset(preset), n_layer=1, d_model=256, n_head=4,
                              d_ff=1024 if preset == "gpt2-tiny" else 688, dropout=0.0, attn_dropout=0.0)
    topo = Topology.solo(DEVICE)
    # `auto` for each dtype: the fp64 copy gets what runs fp64 (torch's), the 16-bit block what a GPU run picks
    ref = Block(cfg, topo, TPRNGTracker(0, 0, DEVICE), device=DEVICE, dtype=torch.float64,
                kernels=resolve_kernels(KernelChoice(), DEVICE, torch.float64))
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    with torch.no_grad():
        for p in ref.parameters():
            noise = torch.randn(p.shape, generator=gen, device=DEVICE, dtype=torch.float64)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else 0.05 * noise)
    block = Block(cfg, topo, TPRNGTracker(0, 0, DEVICE), device=DEVICE, dtype=dt,
                  kernels=resolve_kernels(KernelChoice(), DEVICE, dt))
    block.load_state_dict({k: v.to(dt) for k, v in ref.state_dict().items()})
    ref.load_state_dict({k: v.double() for k, v in block.state_dict().items()})  # the same rounded weights
    x = randn(2, 128, 256, seed=12).to(dt).requires_grad_()
    dy = randn(2, 128, 256, seed=13).to(dt)
    y, saved = run_saving(block, x, dy, dt)
    assert y.dtype == x.grad.dtype == dt
    assert not [s for s in saved if s == (torch.float32, tuple(x.shape))], saved  # no fp32 copy of the stream
    assert_block_matches_fp64(block, ref, x, y, dy, TOL[dt])
