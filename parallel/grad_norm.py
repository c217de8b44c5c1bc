"""Global gradient norm and clipping across tensor-parallel shards.

A tp-sharded parameter's squared gradient norm is split across the tp ranks: sum those pieces with an
all-reduce over tp. A replicated parameter (LayerNorm, row-parallel bias, positions) has the same gradient on
every tp rank: count it once, locally. After the dp all-reduce every dp rank holds the same gradients, so no dp
reduction is needed. Pipeline stages hold different parameters: their sums add up over pp (a tied embedding
present on two stages is counted on one of them only).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megazoo.parallel.collectives import CommLedger, all_reduce
from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology


@torch.no_grad()
def global_grad_norm(named: Iterable[tuple[str, torch.nn.Parameter, ShardSpec]], topo: Topology,
                     skip: frozenset[str] = frozenset()) -> torch.Tensor:
    """L2 norm of all gradients of the full model (parameters named in `skip` left out). Collectives: one
    all-reduce (sum) over tp, one over pp."""
    named = [(param, spec) for name, param, spec in named if param.grad is not None and name not in skip]
    dtype = torch.float64 if any(p.grad.dtype == torch.float64 for p, _ in named) else torch.float32
    sharded = torch.zeros((), dtype=dtype, device=topo.device)
    replicated = torch.zeros((), dtype=dtype, device=topo.device)
    for param, spec in named:
        sq = param.grad.detach().to(dtype).pow(2).sum()
        if spec.dim is not None and spec.size > 1:
            sharded += sq
        else:
            replicated += sq
    if topo.tp_group is not None:
        dist.all_reduce(sharded, group=topo.tp_group)
    total = sharded + replicated
    if topo.pp_group is not None:
        dist.all_reduce(total, group=topo.pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_gradients_(params: Iterable[torch.nn.Parameter], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients so the global norm is at most max_norm (the same rule as torch.nn.utils.clip_grad_norm_)."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))


@torch.no_grad()
def flat_grad_norm(parts: Iterable[tuple[torch.Tensor, bool]], topo: Topology, dp_group=None,
                   ledger: CommLedger | None = None) -> torch.Tensor:
    """L2 norm of flat gradient buffers given as (tensor, tp_sharded): one fused `vector_norm` per buffer (no
    temporaries), sharded squares summed over tp, everything over pp, and over `dp_group` when the buffers are
    dp-partitioned (ZeRO's owned chunks). Collectives: one all-reduce of 2 numbers over dp (if given), one over
    tp, one over pp.

    Each buffer's norm is taken where it lives: ZeRO-Offload's fp32 gradients on the host add up there, and only
    their two sums go to the device (one 2-element copy per step), never the gradients themselves (moving them
    cost a host-to-device copy of every owned fp32 gradient per step, found on fake CUDA)."""
    parts = list(parts)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t, _ in parts) else torch.float32
    sums: dict[torch.device, torch.Tensor] = {}  # device -> [tp-sharded, replicated] squares of its buffers
    for t, sharded in parts:
        if t.numel():
            at = sums.setdefault(t.device, torch.zeros(2, dtype=dtype, device=t.device))
            at[0 if sharded else 1] += torch.linalg.vector_norm(t, dtype=dtype).square()
    sq = torch.zeros(2, dtype=dtype, device=topo.device)
    for at in sums.values():
        sq += at.to(topo.device)
    if dp_group is not None:
        all_reduce(sq, dp_group, ledger=ledger)
    if topo.tp_group is not None:
        sharded_sq = sq[:1].clone()
        dist.all_reduce(sharded_sq, group=topo.tp_group)
        sq[0] = sharded_sq[0]
    total = sq.sum()
    if topo.pp_group is not None:
        dist.all_reduce(total, group=topo.pp_group)
    return total.sqrt()
