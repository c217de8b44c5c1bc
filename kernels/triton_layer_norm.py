"""LayerNorm forward and backward in Triton (reference: kernels/layer_norm.py, layer_norm_reference).

Layout: x viewed as (M rows, N features), one block of BLOCK_M rows x BLOCK_N >= N columns per program, so a
row's statistics are one in-register reduction. Statistics and arithmetic are fp32 whatever the storage dtype.

Forward stores y plus each row's mean and 1/std (fp32, M values each) for the backward, which then needs no
second pass over x to recompute them:
    xhat = (x - mean) * rstd,   g = dy * w
    dx   = rstd * (g - xhat * mean(g * xhat) - mean(g))
    dw   = sum_rows(dy * xhat),  db = sum_rows(dy)
dw/db are column sums over all M rows: each program loops over many row blocks keeping running sums in
registers and writes one partial row; torch adds the few partial rows (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megazoo.kernels import triton_common as tc


@triton.jit
def _layer_norm_fwd(X, W, B, Y, Mean, Rstd, M, N, eps,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]  # int64: M * N may pass 2**31
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)  # padding columns must not enter the variance
    var = tl.sum(xc * xc, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_bwd(X, W, Mean, Rstd, DY, DX, DW_partial, DB_partial, M, N,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_M
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, step):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(xhat * g, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW_partial + pid * N + cols, dw, mask=col_ok)
    tl.store(DB_partial + pid * N + cols, db, mask=col_ok)


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"the Triton LayerNorm takes fp32/bf16/fp16 tensors, got {t.dtype} "
                            f"(use kernels.layer_norm = \"torch\" or \"reference\" for {t.dtype})")


def _blocks(n: int) -> tuple[int, int, int]:
    block_n = tc.next_power_of_2(n)
    return tc.rows_per_program(block_n), block_n, tc.num_warps(block_n)


# Torch ops (kernels/triton_common.py says why custom_op): "megazoo::layer_norm_fwd" returns y and the per-row
# statistics the backward reads; autograd and fake (shape-only) implementations are registered below.
@torch.library.custom_op("megazoo::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(x, weight, bias)
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()  # (M, N), rows dense: the kernels index row * N + col
    m = x2.shape[0]
    y = torch.empty_like(x2)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block_m, block_n, warps = _blocks(n)
    if m:
        _layer_norm_fwd[(triton.cdiv(m, block_m),)](x2, weight.contiguous(), bias.contiguous(), y, mean, rstd,
                                                    m, n, eps, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return y.view(x.shape), mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    _check(x, weight, bias)
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    stats = x.new_empty(m, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.custom_op("megazoo::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                   dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx (x's shape and dtype), dweight and dbias in fp32 (the caller casts them to the parameters' dtypes)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    m = x2.shape[0]
    dy2 = dy.reshape(-1, n).contiguous()
    dx = torch.empty_like(x2)
    block_m, block_n, warps = _blocks(n)
    programs = tc.num_programs_for_reduction(x2.device, triton.cdiv(max(m, 1), block_m))
    dw_partial = torch.zeros(programs, n, dtype=torch.float32, device=x2.device)
    db_partial = torch.zeros_like(dw_partial)
    if m:
        _layer_norm_bwd[(programs,)](x2, weight.contiguous(), mean, rstd, dy2, dx, dw_partial, db_partial, m, n,
                                     BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return dx.view(x.shape), dw_partial.sum(0), db_partial.sum(0)


@layer_norm_bwd.register_fake
def _(x, weight, mean, rstd, dy):
    n = x.shape[-1]
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(n, dtype=torch.float32),
            x.new_empty(n, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = bias.dtype


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd(x, weight, mean, rstd, dy)
    return dx, dw.to(weight.dtype), db.to(ctx.bias_dtype), None


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return layer_norm_fwd(x, weight, bias, eps)[0]


layer_norm_triton.reads_fp32_params = True  # loads weight and bias as fp32: no cast beside a 16-bit x
