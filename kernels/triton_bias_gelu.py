"""Bias add + tanh-GELU in Triton (reference: kernels/bias_gelu.py, bias_gelu_reference).

x viewed as (M rows, N features), tiles of BLOCK_M x BLOCK_N, the bias tile loaded once per program. fp32
arithmetic. Forward saves only x (pre-bias) and the bias: backward recomputes z = x + bias in registers rather
than keeping another (b, s, d_ff) activation alive.
    u = sqrt(2/pi) (z + 0.044715 z^3),  t = tanh(u),  y = 0.5 z (1 + t)
    dy/dz = 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 z^2)
tanh is written with exp (1 - 2 / (e^{2u} + 1), u clamped to +-20 where tanh is +-1 in fp32): it runs the same
compiled and in the interpreter. dbias = dz summed over rows, in fp32, by torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megazoo.kernels import triton_common as tc

K0 = 0.7978845608028654  # sqrt(2 / pi)
K1 = 0.044715


@triton.jit
def _tanh(u):
    u = tl.minimum(tl.maximum(u, -20.0), 20.0)  # tanh(20) is 1 in fp32; keeps exp finite
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows.to(tl.int64)[:, None] * N + cols[None, :], cols, mask


@triton.jit
def _bias_gelu_fwd(X, B, Y, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offsets, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    z = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
    tl.store(Y + offsets, (0.5 * z * (1.0 + t)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd(X, B, DY, DZ, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offsets, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    z = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
    dgelu = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
    tl.store(DZ + offsets, (dy * dgelu).to(DZ.dtype.element_ty), mask=mask)


def _launch(kernel, m: int, n: int, *args) -> None:
    block_n = min(tc.next_power_of_2(n), 1024)
    block_m = tc.rows_per_program(block_n, gpu_elements=4096)
    if m:
        kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](*args, m, n, BLOCK_M=block_m, BLOCK_N=block_n,
                                                                 num_warps=4)


def _check(x: torch.Tensor, bias: torch.Tensor) -> None:
    for t in (x, bias):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"the Triton bias-GELU takes fp32/bf16/fp16 tensors, got {t.dtype}")
    n = x.shape[-1]
    if bias.shape != (n,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match the last dim {n} of x")


# Torch ops (kernels/triton_common.py says why custom_op), with fake (shape-only) and autograd implementations.
@torch.library.custom_op("megazoo::bias_gelu_fwd", mutates_args=())
def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _check(x, bias)
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty_like(x2)
    _launch(_bias_gelu_fwd, x2.shape[0], n, x2, bias.contiguous(), y)
    return y.view(x.shape)


@bias_gelu_fwd.register_fake
def _(x, bias):
    _check(x, bias)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("megazoo::bias_gelu_bwd", mutates_args=())
def bias_gelu_bwd(x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dz = dy * gelu'(x + bias), in x's shape and dtype (dbias is its column sum, taken by the caller)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    dz = torch.empty_like(x2)
    _launch(_bias_gelu_bwd, x2.shape[0], n, x2, bias.contiguous(), dy.reshape(-1, n).contiguous(), dz)
    return dz.view(x.shape)


@bias_gelu_bwd.register_fake
def _(x, bias, dy):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x before the bias, and the bias: backward recomputes z = x + bias


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dz = bias_gelu_bwd(x, bias, dy)
    n = x.shape[-1]
    dbias = dz.reshape(-1, n).sum(0, dtype=torch.float32).to(bias.dtype) if ctx.needs_input_grad[1] else None
    return dz, dbias


bias_gelu_fwd.register_autograd(_backward, setup_context=_setup_context)


def bias_gelu_triton(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias_gelu_fwd(x, bias)
