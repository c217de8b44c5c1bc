"""Plain data parallelism: average gradients over the dp group during backward (ZeRO replaces this).

`GradientAllReducer` is torch DDP's reducer (with `gradient_as_bucket_view=True`) in Python: every gradient is a
view into a flat bucket, so autograd accumulates straight into the buffer that is all-reduced (no cat, no
copy-back). Buckets are filled in reverse registration order (the order backward produces gradients); once every
parameter of a bucket has its gradient (a post-accumulate-grad hook counts them) the bucket's all-reduce (sum)
is launched asynchronously and overlaps the rest of backward. `finish()` waits for them and divides by dp, so
every dp rank holds the same averaged gradient and takes the same optimizer step.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

import torch
import torch.distributed as dist

from megazoo.parallel.collectives import CommLedger, all_reduce, all_reduce_async
from megazoo.parallel.simulation.fake_world import same_memory

BUCKET_ELEMENTS = 1 << 22  # 4 M elements (16 MB fp32) per all-reduce: see README "## Measured"


class GradientAllReducer:
    """Gradients of `params` as views into flat buckets, all-reduced (mean) over `group` as backward produces them.

    `key(param)` keeps parameters with different keys in different buckets (dtype is always part of it), so a
    caller can apply one rule to a whole bucket (the gradient norm's tp-sharded / replicated split).
    Collective: one all-reduce (sum) per bucket over `group`, per accumulation window.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group, bucket_elements: int = BUCKET_ELEMENTS,
                 ledger: CommLedger | None = None, key: Callable[[torch.nn.Parameter], Hashable] | None = None):
        self.group, self.ledger = group, ledger
        self.size = dist.get_world_size(group) if group is not None else 1
        self.divisor = self.size  # the mean's denominator (expert weights: all dp x cp ranks, expert/zero.py)
        filling: dict[Hashable, list[torch.nn.Parameter]] = {}
        closed: list[tuple[Hashable, list[torch.nn.Parameter]]] = []
        for p in reversed([p for p in params if p.requires_grad]):
            k = (p.dtype, p.device, key(p) if key else None)
            current = filling.setdefault(k, [])
            if current and sum(q.numel() for q in current) + p.numel() > bucket_elements:
                closed.append((k, current))
                current = filling[k] = []
            current.append(p)
        closed.extend((k, ps) for k, ps in filling.items() if ps)
        self.keys = [k[2] for k, _ in closed]
        self.params = [ps for _, ps in closed]
        self.flats = [torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
                      for ps in self.params]
        self._views: dict[torch.nn.Parameter, tuple[int, torch.Tensor]] = {}
        for i, (ps, flat) in enumerate(zip(self.params, self.flats)):
            offset = 0
            for p in ps:
                view = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                self._views[p] = (i, view)
                p.grad = view  # autograd accumulates in place into the bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._ready = [0] * len(self.flats)
        self._works: dict[int, object] = {}
        self._reduce_now = True

    def begin(self, reduce: bool) -> None:
        """Before a backward: `reduce` says whether it closes the accumulation window (only then all-reduce)."""
        self._reduce_now = reduce
        self._ready = [0] * len(self.flats)

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        i, view = self._views[param]
        if not same_memory(param.grad, view):  # .grad was replaced (set to None elsewhere): re-home it
            view.copy_(param.grad)
            param.grad = view
        self._ready[i] += 1
        if self._reduce_now and self._ready[i] == len(self.params[i]):
            self._launch(i)

    def _launch(self, i: int) -> None:
        if i in self._works or self.group is None:
            return
        self._works[i] = all_reduce_async(self.flats[i], self.group, ledger=self.ledger)

    @torch.no_grad()
    def finish(self) -> None:
        """Launch what backward did not (buckets with unused parameters, on every rank alike), wait, average."""
        if self.group is None:
            if self.divisor != 1:
                for flat in self.flats:
                    flat.div_(self.divisor)
            return
        for i in range(len(self.flats)):
            self._launch(i)
        for i, work in sorted(self._works.items()):
            work.wait()
            self.flats[i].div_(self.divisor)
        self._works.clear()

    @torch.no_grad()
    def zero_(self) -> None:
        """Zero every bucket (the next window accumulates from zero) and point .grad back into the buckets."""
        for flat in self.flats:
            flat.zero_()
        for p, (_, view) in self._views.items():
            if p.grad is None or not same_memory(p.grad, view):
                p.grad = view


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
    """Average .grad over the data-parallel `group` (None: nothing to do), after backward, synchronously: for
    callers without hooks. Collective: all-reduce (sum)."""
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
