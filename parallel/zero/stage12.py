"""ZeRO stages 1 and 2: optimizer states (1) and gradients (2) partitioned over the data-parallel group.

Every dp rank keeps full parameters (in flat buckets, buckets.py) but fp32 master weights and Adam moments only
for the chunk of each bucket it owns (partitioned.py). One step:

  backward    gradient hooks fill buckets; a full bucket's gradient is reduce-scattered (sum) over dp into the
              owner's chunk, asynchronously, while backward continues.
              stage 1: gradients accumulate in full-size buffers over the micro-batches and reduce once, during
                       the last micro-batch's backward.
              stage 2: every micro-batch reduces; each full-size bucket buffer is freed as soon as its
                       reduce-scatter is done, so between micro-batches a rank holds only its owned gradient chunk.
  step        global grad norm over owned chunks, clip, AdamW on the owned fp32 chunks, cast back into the
              bucket, all-gather each bucket over dp.

Collectives per step, per bucket: one reduce-scatter (stage 2: per micro-batch) and one all-gather over dp:
the same 2 x params x (dp-1)/dp elements per rank as plain data parallelism's all-reduce.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from megazoo.parallel.collectives import all_gather_flat
from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.buckets import DEFAULT_BUCKET_ELEMENTS, build_buckets
from megazoo.parallel.zero.interface import NothingToGather
from megazoo.parallel.zero.partitioned import PartitionedOptimizer, TiedParameters


class ZeroStage12(NothingToGather, PartitionedOptimizer):
    """Wraps a model's parameters; replaces the dp all-reduce and the optimizer of plain data parallelism."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter, ShardSpec]], topo: Topology, *, stage: int,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, offload: str = "none",
                 tied: TiedParameters = TiedParameters(), group_of: Callable[[str], Hashable] | None = None,
                 adamw: Callable | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroStage12 implements zero stage 1 or 2, not {stage}")
        def bucket_group(name: str):  # tied parameters alone; otherwise the caller's grouping
            return ("tied", name) if name in tied.names else (group_of(name) if group_of else None)

        buckets = build_buckets(named, topo.dp, topo.dp_rank, bucket_elements, bucket_group)
        super().__init__(buckets, [b.flat_params[b.owned] for b in buckets], topo, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, offload=offload, tied=tied,
                         specs={name: spec for name, _, spec in named}, adamw=adamw)
        self.stage = stage
        # stage 1 keeps full-size gradient buffers for the whole step; stage 2 allocates one per reduction.
        self.full_grads: list[torch.Tensor | None] = [
            torch.zeros(b.numel, dtype=b.dtype, device=b.flat_params.device) if stage == 1 else None
            for b in self.buckets]
        self._ready = [0] * len(self.buckets)
        self._launched: set[int] = set()
        self._reduce_now = True
        self._where = {}
        for i, b in enumerate(self.buckets):
            for p, off in zip(b.params, b.offsets):
                self._where[p] = (i, off)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if stage == 1:
            for b, flat in zip(self.buckets, self.full_grads):
                for p, view in b.views(flat):
                    p.grad = view  # autograd accumulates in place into the bucket

    def begin_micro_batch(self, last: bool) -> None:
        """Say whether the coming backward is the accumulation boundary (stage 1 reduces only then)."""
        self._reduce_now = last or self.stage == 2
        self._ready = [0] * len(self.buckets)
        self._launched.clear()

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        i, off = self._where[param]
        bucket = self.buckets[i]
        if self.stage == 2:
            if self.full_grads[i] is None:
                self.full_grads[i] = torch.zeros(bucket.numel, dtype=bucket.dtype, device=param.device)
            self.full_grads[i][off:off + param.numel()].copy_(param.grad.view(-1))
            param.grad = None  # the full-size gradient lives only until its bucket is reduced
        self._ready[i] += 1
        if self._reduce_now and self._ready[i] == len(bucket.params):
            self._launch_reduce(i)

    def _launch_reduce(self, i: int) -> None:
        bucket = self.buckets[i]
        if self.full_grads[i] is None:  # stage 2, no parameter of this bucket received a gradient
            self.full_grads[i] = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.flat_params.device)
        self._launched.add(i)
        flat = self.full_grads[i]
        if self.stage == 2:
            # The reducer owns the buffer from here: the next micro-batch's gradients go to a new one.
            self.full_grads[i] = None
            self.reducer.launch(flat, self.owned_grads[i])
        else:
            self.reducer.launch(flat, self.owned_grads[i], on_done=flat.zero_)

    def finish_gradients(self) -> None:
        """Wait for every reduce-scatter of this step; owned_grads then hold the dp-mean gradient chunk."""
        if self._reduce_now:  # buckets with unused parameters never filled: reduce them now, on every rank alike
            for i in range(len(self.buckets)):
                if i not in self._launched:
                    self._launch_reduce(i)
        self.reducer.drain()
        self.sum_tied_gradients()

    @torch.no_grad()
    def after_load(self) -> None:
        """Nothing to redo: the full parameters were loaded in place (every dp rank reads them)."""

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """AdamW on the owned chunks, then all-gather every bucket's parameters over dp."""
        for b, owned in zip(self.buckets, self.update_owned(lr)):
            b.flat_params[b.owned].copy_(owned)
            if self.group is not None:
                all_gather_flat(b.flat_params, owned, self.group, ledger=self.comm)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states (fp32 masters + Adam moments)."""
        params = sum(b.flat_params.numel() * b.flat_params.element_size() for b in self.buckets)
        grads = self.owned_grad_bytes() + self.reducer.in_flight_bytes()
        grads += sum(f.numel() * f.element_size() for f in self.full_grads if f is not None)
        return {"params": params, "grads": grads, "optimizer": self.optimizer_bytes()}
