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
