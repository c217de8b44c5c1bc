"""Thin, version-tolerant names for the flat collectives (torch 2.13 renamed the *_into_tensor forms).

Both take/produce tensors concatenated along dim 0: all_gather_flat(out[size * n, ...], x[n, ...]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """out = cat([x from rank 0, x from rank 1, ...], dim=0)."""
    return _all_gather_single(out, x, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """out = (sum over ranks of x).chunk(size, dim=0)[rank]."""
    return _reduce_scatter_single(out, x, op=op, group=group, async_op=async_op)


def all_gather_stacked(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(size, *x.shape): every rank's x, stacked along a new leading dim."""
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]) if x.dim() else (size,), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x if x.dim() else x.view(1), group)
    return out.view(size, *x.shape)
