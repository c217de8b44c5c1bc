"""Scaled, causally masked softmax in Triton (reference: kernels/attention.py, scaled_causal_softmax_reference).

For attention that is not done by SDPA: scores (..., s, s) -> softmax(scale * scores) over the last dim with
column j > row i masked (it never receives probability). Rows are (batch * heads * s) lines of s columns; a
program takes BLOCK_M whole rows (BLOCK_N >= s), so max and sum are in-register reductions, in fp32.
    forward   p = exp(scale x - max) / sum, 0 above the diagonal
    backward  dx = scale * p * (dp - sum(dp * p))      (from the saved probabilities; masked entries get 0)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megazoo.kernels import triton_common as tc


@triton.jit
def _causal_softmax_fwd(X, P, M, S, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    query = rows % S  # the row's position inside its (s, s) matrix
    inside = (rows < M)[:, None] & (cols < S)[None, :]
    keep = inside & (cols[None, :] <= query[:, None])
    offsets = rows.to(tl.int64)[:, None] * S + cols[None, :]
    x = tl.load(X + offsets, mask=keep, other=float("-inf")).to(tl.float32) * scale
    x = tl.where(keep, x, float("-inf"))
    row_max = tl.max(x, axis=1)  # finite: column 0 is always kept
    row_max = tl.where(rows < M, row_max, 0.0)  # rows past the end: all -inf, keep them finite (not stored)
    e = tl.exp(x - row_max[:, None])
    p = e / tl.where(rows < M, tl.sum(e, axis=1), 1.0)[:, None]
    tl.store(P + offsets, p.to(P.dtype.element_ty), mask=inside)


@triton.jit
def _causal_softmax_bwd(P, DP, DX, M, S, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    inside = (rows < M)[:, None] & (cols < S)[None, :]
    offsets = rows.to(tl.int64)[:, None] * S + cols[None, :]
    p = tl.load(P + offsets, mask=inside, other=0.0).to(tl.float32)
    dp = tl.load(DP + offsets, mask=inside, other=0.0).to(tl.float32)
    dx = scale * p * (dp - tl.sum(dp * p, axis=1)[:, None])
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=inside)


def _blocks(s: int) -> tuple[int, int, int]:
    block_n = tc.next_power_of_2(s)
    return tc.rows_per_program(block_n), block_n, tc.num_warps(block_n)


def _check(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton softmax takes fp32/bf16/fp16 scores, got {x.dtype}")
    s = x.shape[-1]
    if x.dim() < 2 or x.shape[-2] != s:
        raise ValueError(f"causal softmax needs square (..., s, s) scores, got {tuple(x.shape)}")


# Torch ops (kernels/triton_common.py says why custom_op), with fake (shape-only) and autograd implementations.
@torch.library.custom_op("megazoo::causal_softmax_fwd", mutates_args=())
def causal_softmax_fwd(x: torch.Tensor, scale: float) -> torch.Tensor:
    _check(x)
    s = x.shape[-1]
    x2 = x.reshape(-1, s).contiguous()
    p = torch.empty_like(x2)
    block_m, block_n, warps = _blocks(s)
    if x2.shape[0]:
        _causal_softmax_fwd[(triton.cdiv(x2.shape[0], block_m),)](x2, p, x2.shape[0], s, scale, BLOCK_M=block_m,
                                                                 BLOCK_N=block_n, num_warps=warps)
    return p.view(x.shape)


@causal_softmax_fwd.register_fake
def _(x, scale):
    _check(x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("megazoo::causal_softmax_bwd", mutates_args=())
def causal_softmax_bwd(p: torch.Tensor, dp: torch.Tensor, scale: float) -> torch.Tensor:
    s = p.shape[-1]
    p2 = p.reshape(-1, s).contiguous()
    m = p2.shape[0]
    dx = torch.empty_like(p2)
    block_m, block_n, warps = _blocks(s)
    if m:
        _causal_softmax_bwd[(triton.cdiv(m, block_m),)](p2, dp.reshape(-1, s).contiguous(), dx, m, s, scale,
                                                       BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return dx.view(p.shape)


@causal_softmax_bwd.register_fake
def _(p, dp, scale):
    return torch.empty_like(p, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)  # the probabilities: backward needs nothing else
    ctx.scale = inputs[1]


def _backward(ctx, dp):
    (p,) = ctx.saved_tensors
    return causal_softmax_bwd(p, dp, ctx.scale), None


causal_softmax_fwd.register_autograd(_backward, setup_context=_setup_context)


def scaled_causal_softmax_triton(scores: torch.Tensor, scale: float) -> torch.Tensor:
    return causal_softmax_fwd(scores, scale)
