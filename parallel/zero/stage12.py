"""ZeRO stages 1 and 2: optimizer states (1) and gradients (2) partitioned over the data-parallel group.

Every dp rank keeps full parameters (in flat buckets, buckets.py) but fp32 master weights and Adam moments only
for the chunk of each bucket it owns (partitioned.py). One step:

  backward    gradient hooks fill buckets; a full bucket's gradient is reduce-scattered (sum) over dp into the
              owner's chunk, asynchronously, while backward continues.
              stage 1: gradients accumulate in full-size buffers over the micro-batches and reduce once, during
                       the last micro-batch's backward.
              stage 2: every micro-batch reduces; each full-size bucket buffer comes from the reducer's pool
                       and goes back to it as soon as its reduce-scatter is done (the next bucket reuses it), so
                       between micro-batches a rank holds only its owned gradient chunk.
  step        global grad norm over owned chunks (one fused norm each), clip, AdamW on the owned fp32 chunks
              (fp32 training: the chunk of the bucket itself, no copy), then every bucket's all-gather over dp (in
              place) is launched asynchronously, in the order the next forward needs them (prefetch): a forward
              pre-hook on each module (except the top-level model) waits only for the buckets holding its own
              and its submodules' parameters, so the gathers overlap the next forward. Contract, as for stage 3
              and FSDP: a parameter is read inside the forward of a module that contains it (the top-level
              model's forward may read a submodule's parameter once that submodule has run: GPT's tied head).
              Without a `model` covering every parameter, or with no dp group, the step waits for the gathers.
              Anything that reads parameters outside a forward (gathered(), checkpoint views, loading, the next
              backward) waits for them first.

Collectives per step, per bucket: one reduce-scatter (stage 2: per micro-batch) and one all-gather over dp:
the same 2 x params x (dp-1)/dp elements per rank as plain data parallelism's all-reduce. HSDP
(zero.shard_group = "node", groups.py): both run over the node's dp ranks, and the owned gradient chunk is
all-reduced over the nodes once per step, in the last micro-batch's backward (stage 2 accumulates the node's
sums of the earlier micro-batches in the owned chunk first).
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch
import torch.nn as nn

from megazoo.parallel.collectives import all_gather_flat
from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.buckets import DEFAULT_BUCKET_ELEMENTS, build_buckets
from megazoo.parallel.zero.groups import ShardGroups, shard_groups
from megazoo.parallel.zero.interface import NothingToGather
from megazoo.parallel.zero.partitioned import PartitionedOptimizer, TiedParameters


class ZeroStage12(NothingToGather, PartitionedOptimizer):
    """Wraps a model's parameters; replaces the dp all-reduce and the optimizer of plain data parallelism."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter, ShardSpec]], topo: Topology, *, stage: int,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, offload: str = "none",
                 tied: TiedParameters = TiedParameters(), group_of: Callable[[str], Hashable] | None = None,
                 adamw: Callable | None = None, model: nn.Module | None = None, groups: ShardGroups | None = None,
                 units: Sequence[nn.Module] = ()):
        if stage not in (1, 2):
            raise ValueError(f"ZeroStage12 implements zero stage 1 or 2, not {stage}")
        def bucket_group(name: str):  # tied parameters alone; otherwise the caller's grouping
            return ("tied", name) if name in tied.names else (group_of(name) if group_of else None)

        groups = groups or shard_groups(topo)  # flat over dp, or HSDP: over the node's dp ranks (groups.py)
        buckets = build_buckets(named, groups.shard_size, groups.shard_rank, bucket_elements, bucket_group)
        super().__init__(buckets, [b.flat_params[b.owned] for b in buckets], topo, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, offload=offload, tied=tied,
                         specs={name: spec for name, _, spec in named}, adamw=adamw, groups=groups)
        self.stage = stage
        self.after_update: Callable[[], None] | None = None  # run by step() between the update and the gathers
        # Frozen parameters (LoRA's base weights) are in no bucket: held whole on every rank, no optimizer state.
        self.frozen_bytes = sum(p.numel() * p.element_size() for _, p, _ in named if not p.requires_grad)
        # stage 1 keeps full-size gradient buffers for the whole step; stage 2 allocates one per reduction.
        self.full_grads: list[torch.Tensor | None] = [
            torch.zeros(b.numel, dtype=b.dtype, device=b.flat_params.device) if stage == 1 else None
            for b in self.buckets]
        self._ready = [0] * len(self.buckets)
        self._got: list[set[int]] = [set() for _ in self.buckets]  # stage 2: parameters copied into the bucket
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
        self._gathers: dict[int, object] = {}  # bucket -> its all-gather in flight since the step
        self._prefetch = model is not None and self.group is not None and self._hook_forwards(model, units)

    # ---- the all-gathers after the step, waited where the next forward needs them ---------------------------
    def _hook_forwards(self, model: nn.Module, units: Sequence[nn.Module]) -> bool:
        """Each module's forward waits for the buckets of its parameters. The model's own forward waits for every
        bucket holding a parameter outside `units` (the blocks): it may read those without calling their module
        (the tied head is `wte.head(x)`, so on a last pipeline stage the embedding's pre-hook never runs and the
        head read the weight while its all-gather was still arriving). Without units it waits for all."""
        bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b.params}
        reached = {p for m in model.modules() for p in m.parameters(recurse=False)}
        if not all(p in reached for p in bucket_of):
            return False  # some bucketed parameter lives outside `model`: wait in the step
        in_units = {p for u in units for p in u.parameters()}
        root = {bucket_of[p] for p in model.parameters() if p in bucket_of and p not in in_units}
        for m in model.modules():
            needs = sorted({bucket_of[p] for p in m.parameters(recurse=m is not model) if p in bucket_of}
                           | (root if m is model else set()))
            if needs:
                m.register_forward_pre_hook(lambda mod, args, needs=needs: self._wait_gathers(needs))
        return True

    def _wait_gathers(self, buckets=None) -> None:
        if self._gathers:
            todo = list(self._gathers) if buckets is None else [i for i in buckets if i in self._gathers]
            self._timed_wait([self._gathers.pop(i) for i in todo])

    def begin_micro_batch(self, last: bool) -> None:
        """Say whether the coming backward is the accumulation boundary (stage 1 reduces only then)."""
        self._wait_gathers()
        if self.stage == 2:
            # The previous backward's last reductions (at most MAX_REDUCTIONS_IN_FLIGHT, on the first stage the
            # embedding's bucket among them) ran during the forwards since: take them in now and let the pool's
            # free buffers go, so that between micro-batches only the owned chunks are held (a free 0.5 GB
            # embedding bucket would otherwise sit through the whole next backward of a 405B tp-8 first stage).
            self.reducer.finish_launched()
            self.reducer.pool.clear()
        self._reduce_now = last or self.stage == 2
        self.reducer.cross_now = last  # HSDP: only the step's last backward crosses nodes
        self._ready = [0] * len(self.buckets)
        self._got = [set() for _ in self.buckets]
        self._launched.clear()

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        i, off = self._where[param]
        bucket = self.buckets[i]
        if self.stage == 2:
            if self.full_grads[i] is None:  # uninitialised: every range is written below or zeroed at launch
                self.full_grads[i] = self.reducer.pool.take(bucket.numel, bucket.dtype, param.device)
            self.full_grads[i][off:off + param.numel()].copy_(param.grad.view(-1))
            self._got[i].add(off)
            param.grad = None  # the full-size gradient lives only until its bucket is reduced
        self._ready[i] += 1
        if self._reduce_now and self._ready[i] == len(bucket.params):
            self._launch_reduce(i)

    def _launch_reduce(self, i: int) -> None:
        bucket = self.buckets[i]
        if self.full_grads[i] is None:  # stage 2, no parameter of this bucket received a gradient
            self.full_grads[i] = self.reducer.pool.take(bucket.numel, bucket.dtype, bucket.flat_params.device)
        self._launched.add(i)
        flat = self.full_grads[i]
        if self.stage == 2:
            end = bucket.offsets[-1] + bucket.params[-1].numel()
            flat[end:].zero_()  # padding, and below: parameters that got no gradient (a reused buffer is dirty)
            for p, off in zip(bucket.params, bucket.offsets):
                if off not in self._got[i]:
                    flat[off:off + p.numel()].zero_()
            # The reducer owns the buffer from here and gives it back to the pool when the reduction is done.
            self.full_grads[i] = None
            self.reducer.launch(flat, self.owned_grads[i], on_done=lambda: self.reducer.pool.give(flat), key=i)
        else:
            self.reducer.launch(flat, self.owned_grads[i], on_done=flat.zero_, key=i)

    def finish_gradients(self) -> None:
        """Wait for every reduce-scatter of this step; owned_grads then hold the dp-mean gradient chunk."""
        self._wait_gathers()
        if self._reduce_now:  # buckets with unused parameters never filled: reduce them now, on every rank alike
            for i in range(len(self.buckets)):
                if i not in self._launched:
                    self._launch_reduce(i)
        self.reducer.drain()
        self.sum_tied_gradients()

    @torch.no_grad()
    def after_load(self) -> None:
        """Nothing to redo: the full parameters were loaded in place (every dp rank reads them)."""
        self._wait_gathers()

    def gathered(self):
        """Full parameters are always held; wait for the step's all-gathers so they are the updated ones."""
        self._wait_gathers()
        return super().gathered()

    def state_views(self):
        self._wait_gathers()
        return super().state_views()

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """AdamW on the owned chunks, then all-gather every bucket's parameters over dp (all launched, then
        waited: the gathers queue back to back; in place when the master aliases the bucket's chunk)."""
        self._wait_gathers()
        self.update_owned(lr)
        if self.after_update is not None:  # DiLoCo's outer step: on the updated masters, before they are gathered
            self.after_update()
        for i in reversed(range(len(self.buckets))):  # buckets are in backward order: the forward needs the last first
            b = self.buckets[i]
            mine = b.flat_params[b.owned]
            self.write_owned(i, mine)
            if self.group is not None:
                self._gathers[i] = all_gather_flat(b.flat_params, mine, self.group, async_op=True, ledger=self.comm)
        if not self._prefetch:
            self._wait_gathers()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states (fp32 masters + Adam moments)."""
        params = self.frozen_bytes + sum(b.flat_params.numel() * b.flat_params.element_size() for b in self.buckets)
        grads = self.owned_grad_bytes() + self.reducer.in_flight_bytes()  # stage 2's buckets: in the pool
        if self.stage == 1:
            grads += sum(f.numel() * f.element_size() for f in self.full_grads)
        return {"params": params, "grads": grads, "optimizer": self.optimizer_bytes()}
