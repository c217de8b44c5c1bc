"""Plain data parallelism: average gradients over the dp group after backward (ZeRO replaces this).

Gradients are packed into flat buckets (one all-reduce per bucket instead of one per parameter), summed with
all-reduce over the dp group, divided by dp, and copied back. Every dp rank then holds the same averaged
gradient and takes the same optimizer step.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megazoo.parallel.collectives import CommLedger, all_reduce

BUCKET_ELEMENTS = 1 << 24  # 16 M elements (64 MB fp32) per all-reduce


def _buckets(grads: list[torch.Tensor], limit: int):
    bucket, size = [], 0
    for g in grads:
        if bucket and (size + g.numel() > limit or g.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    if bucket:
        yield bucket


@torch.no_grad()
def all_reduce_gradients(params: Iterable[torch.nn.Parameter], group, bucket_elements: int = BUCKET_ELEMENTS,
                         ledger: CommLedger | None = None):
    """Average .grad over the data-parallel `group` (None: nothing to do). Collective: all-reduce (sum)."""
    if group is None:
        return
    size = dist.get_world_size(group)
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads, bucket_elements):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        all_reduce(flat, group, ledger=ledger)
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
