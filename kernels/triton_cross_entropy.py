"""Vocab-parallel cross-entropy in Triton (reference: parallel/tensor/cross_entropy.py; the tp combination and
the autograd Function live in kernels/cross_entropy.py).

The logits (M rows, V local columns, bf16 or fp32) are read in BLOCK_M x BLOCK_V tiles and converted to fp32 in
registers only: no fp32 copy of any part of the logits ever exists in memory.
    stats     one pass over a row's valid columns with an online softmax: running max m and running
              sum of exp(x - m), rescaled when m grows; plus the target's logit when this rank owns it.
    grad      d loss / d x = (exp(x - lse) - onehot(target)) * dloss, written straight in the logits' dtype;
              padding columns (ids >= the true vocabulary) get exactly 0.
`local_target` is the target id minus this shard's first id, or -1 when another rank owns it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megazoo.kernels import triton_common as tc


@triton.jit
def _ce_stats(X, T, Max, SumExp, TargetLogit, M, V, n_valid, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    base = rows.to(tl.int64) * V
    target = tl.load(T + rows, mask=row_ok, other=-1)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.float32)
    t = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n_valid, BLOCK_V):  # padding columns are never read: they get no probability
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < n_valid)[None, :]
        x = tl.load(X + base[:, None] + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=1))
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)  # a row with nothing valid yet: avoid inf - inf
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        m = new_m
        t += tl.sum(tl.where(cols[None, :] == target[:, None], x, 0.0), axis=1)
    tl.store(Max + rows, m, mask=row_ok)
    tl.store(SumExp + rows, s, mask=row_ok)
    tl.store(TargetLogit + rows, t, mask=row_ok)


@triton.jit
def _ce_grad(X, T, LSE, Scale, DX, M, V, n_valid, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < M
    inside = row_ok[:, None] & (cols < V)[None, :]
    offsets = rows.to(tl.int64)[:, None] * V + cols[None, :]
    x = tl.load(X + offsets, mask=inside & (cols < n_valid)[None, :], other=float("-inf")).to(tl.float32)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    scale = tl.load(Scale + rows, mask=row_ok, other=0.0)
    target = tl.load(T + rows, mask=row_ok, other=-1)
    p = tl.exp(x - lse[:, None]) - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
    tl.store(DX + offsets, (p * scale[:, None]).to(DX.dtype.element_ty), mask=inside)


def _blocks(v: int, block_v: int | None) -> tuple[int, int]:
    """(rows, columns) per tile: a few rows per program on a GPU (thousands of programs keep every SM busy),
    many in the interpreter (fewer Python-level programs)."""
    block_v = block_v or min(tc.next_power_of_2(v), 512 if tc.INTERPRETED else 1024)
    return (32 if tc.INTERPRETED else 4), block_v


# Torch ops (kernels/triton_common.py says why custom_op) with fake (shape-only) implementations. They need no
# autograd formula: kernels/cross_entropy.py's autograd Function calls "stats" in its forward and "grad" in its
# backward (the tp all-reduces between them are its own). block_v 0: the default tile width.
@torch.library.custom_op("megazoo::cross_entropy_stats", mutates_args=())
def cross_entropy_stats(logits: torch.Tensor, local_target: torch.Tensor, n_valid: int,
                        block_v: int) -> torch.Tensor:
    """(3, M) fp32: each row's max, sum of exp(x - max) and target logit (0 where another rank owns it)."""
    _check(logits)
    m, v = logits.shape
    stats = torch.empty(3, m, dtype=torch.float32, device=logits.device)
    block_m, block_v = _blocks(v, block_v or None)
    if m:
        _ce_stats[(triton.cdiv(m, block_m),)](logits, local_target, stats[0], stats[1], stats[2], m, v, n_valid,
                                              BLOCK_M=block_m, BLOCK_V=block_v, num_warps=8)
    return stats


@cross_entropy_stats.register_fake
def _(logits, local_target, n_valid, block_v):
    _check(logits)
    return logits.new_empty(3, logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("megazoo::cross_entropy_grad", mutates_args=())
def cross_entropy_grad(logits: torch.Tensor, local_target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                       n_valid: int, block_v: int) -> torch.Tensor:
    m, v = logits.shape
    grad = torch.empty_like(logits)
    block_m, block_v = _blocks(v, block_v or None)
    if m:
        _ce_grad[(triton.cdiv(m, block_m), triton.cdiv(v, block_v))](
            logits, local_target, lse, scale, grad, m, v, n_valid, BLOCK_M=block_m, BLOCK_V=block_v, num_warps=8)
    return grad


@cross_entropy_grad.register_fake
def _(logits, local_target, lse, scale, n_valid, block_v):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _check(logits: torch.Tensor) -> None:
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton cross-entropy takes fp32/bf16/fp16 logits, got {logits.dtype}")


class TritonBackend:
    """Per-row statistics and the gradient for kernels/cross_entropy.py's vocab-parallel Function."""

    name = "triton"

    def __init__(self, block_v: int | None = None):
        if block_v is not None and block_v & (block_v - 1):
            raise ValueError(f"block_v = {block_v} must be a power of two")
        self.block_v = block_v

    def local_stats(self, logits: torch.Tensor, local_target: torch.Tensor, n_valid: int):
        stats = cross_entropy_stats(logits, local_target, n_valid, self.block_v or 0)
        return stats[0], stats[1], stats[2]

    def grad(self, logits: torch.Tensor, local_target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
             n_valid: int) -> torch.Tensor:
        return cross_entropy_grad(logits, local_target, lse, scale, n_valid, self.block_v or 0)
