"""Flat, dp-partitioned buckets of parameters: the memory layout of ZeRO stages 1 and 2.

Parameters are grouped into buckets of at most `bucket_elements` elements, in reverse registration order (the
order backward produces gradients, so the first bucket fills first and its reduce-scatter overlaps the rest of
backward). A bucket only holds parameters that agree on dtype, weight decay and whether they are tensor-parallel
sharded, so one optimizer setting and one gradient-norm rule applies to the whole bucket.

Each bucket's flat storage is padded to a multiple of dp and every dp rank owns the same contiguous 1/dp
chunk of *every bucket*. Why per bucket and not one contiguous 1/dp range of the whole model (as DeepSpeed
stage 1/2): with per-bucket ownership a bucket's gradients reduce with one true `reduce_scatter_tensor` into
exactly the owner's chunk, launched as soon as the bucket is ready; a single global range would need one
`reduce` per (bucket, owner) pair instead.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from megazoo.parallel.simulation.fake_world import memory_key
from megazoo.parallel.tensor import ShardSpec

DEFAULT_BUCKET_ELEMENTS = 1 << 22  # 4 M elements per bucket (16 MB in fp32): see README "## Measured"


@dataclass
class Bucket:
    names: list[str]
    params: list[torch.nn.Parameter]
    offsets: list[int]  # start of each parameter in the flat buffer
    numel: int  # padded flat size, a multiple of dp
    dtype: torch.dtype
    weight_decay: bool
    tp_sharded: bool
    dp: int
    dp_rank: int
    flat_params: torch.Tensor = field(init=False)  # every parameter of the bucket is a view into this

    @property
    def chunk(self) -> int:
        return self.numel // self.dp

    @property
    def owned(self) -> slice:
        return slice(self.dp_rank * self.chunk, (self.dp_rank + 1) * self.chunk)

    def views(self, flat: torch.Tensor):
        """(param, view of `flat` shaped like the param) for every parameter of the bucket."""
        for p, off in zip(self.params, self.offsets):
            yield p, flat[off:off + p.numel()].view_as(p)


def _bucket_key(param: torch.nn.Parameter, spec: ShardSpec) -> tuple:
    return (param.dtype, param.dim() >= 2, spec.dim is not None and spec.size > 1)


def build_buckets(named: list[tuple[str, torch.nn.Parameter, ShardSpec]], dp: int, dp_rank: int,
                  bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
                  group_of: Callable[[str], Hashable] | None = None, frozen: bool = False) -> list[Bucket]:
    """Lay every trainable parameter (with `frozen`: every frozen one instead, for ZeRO-3 to partition without
    optimizer state) out in flat buckets and make the parameters views into them.

    `group_of(name)` adds to the bucket key: parameters of different groups never share a bucket (pipeline
    chunks, a tied embedding that must sit alone so its owned chunk lines up on both pipeline ends). The
    parameters keep their values; their storage moves into the buckets' flat buffers.
    """
    filling: dict[tuple, list[tuple[str, torch.nn.Parameter]]] = {}  # one bucket being filled per key
    closed: list[tuple[tuple, list[tuple[str, torch.nn.Parameter]]]] = []
    for name, param, spec in reversed(named):
        if param.requires_grad == frozen:
            continue
        key = (*_bucket_key(param, spec), group_of(name) if group_of else None)
        current = filling.setdefault(key, [])
        if current and sum(p.numel() for _, p in current) + param.numel() > bucket_elements:
            closed.append((key, current))
            current = filling[key] = []
        current.append((name, param))
    closed.extend((key, entries) for key, entries in filling.items() if entries)

    buckets = []
    for (dtype, decay, sharded, _), entries in closed:
        params = [p for _, p in entries]
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        padded = -(-total // dp) * dp
        bucket = Bucket([n for n, _ in entries], params, offsets, padded, dtype, decay, sharded, dp, dp_rank)
        bucket.flat_params = torch.zeros(padded, dtype=dtype, device=params[0].device)
        for p, view in bucket.views(bucket.flat_params):
            view.copy_(p.detach())
            p.data = view  # the parameter now lives in the bucket
        buckets.append(bucket)
    return buckets


class BufferPool:
    """Flat buffers reused within one step: full-size gradient buckets and reduce-scatter outputs are taken and
    given back as reductions complete, so a backward allocates (and the OS zero-fills) a few buffers instead of
    one per bucket per micro-batch. `take` hands out a view of the smallest free buffer that fits (at most 1.25x
the request), uninitialised
(on a miss, the free buffers of that dtype are released before a new one is allocated);
    `clear()` (end of the step's reductions) returns everything to the allocator, so nothing is held between
    steps. `nbytes()` is what the pool holds right now, lent or free (counted in memory_bytes)."""

    def __init__(self):
        self._free: list[torch.Tensor] = []
        self._lent: dict[tuple, torch.Tensor] = {}  # memory_key of a lent view -> its buffer
        self.allocated: Counter[int] = Counter()  # numel -> buffers allocated (misses), for tests and profiles

    def take(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        # Within a quarter of the request: a small reduce-scatter output must not occupy the full-size buffer the
        # next unit's gradients are about to need (stage 3 would then allocate a second one).
        fits = [i for i, b in enumerate(self._free) if numel <= b.numel() <= numel + numel // 4
                and b.dtype == dtype and b.device == device]
        if fits:
            buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            # A miss (stage 3: the root unit's larger buffer at the end of backward; stage 2: a parameter larger
            # than the bucket size, which fills a bucket of its own): first let go of the free buffers of this
            # dtype, so they are not held next to the new one. Larger ones too: a large bucket given back at the
            # end of one backward (the embedding's, 0.5 GB on a 405B tp-8 stage) would otherwise stay free
            # through the whole of the next micro-batch's backward until its own gradient needs it again.
            self._free = [b for b in self._free if b.dtype != dtype or b.device != device]
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self.allocated[numel] += 1
        view = buffer[:numel]
        self._lent[memory_key(view)] = buffer
        return view

    def give(self, view: torch.Tensor) -> None:
        buffer = self._lent.pop(memory_key(view), None)
        if buffer is not None:
            self._free.append(buffer)

    def release(self, view: torch.Tensor) -> bool:
        """Hand a lent view over to the caller for good, when it is its whole buffer; False (still lent) if not."""
        key = memory_key(view)
        if key in self._lent and self._lent[key].numel() == view.numel():
            del self._lent[key]
            return True
        return False

    def clear(self) -> None:
        self._free.clear()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._free + list(self._lent.values()))
