"""ZeRO stage 3: parameters themselves partitioned over dp, gathered one unit at a time.

The model is split into units: each given submodule (for a GPT, each block) and a root unit holding every other
parameter (embeddings, final LayerNorm). A unit's parameters live in flat dp-partitioned buckets (buckets.py);
between uses a rank keeps only its owned chunk and the full buffer's storage is freed (resized to 0 bytes, so
the parameters stay the same tensors and autograd's saved references stay valid).

Collectives (all over dp), per micro-batch:
  forward     all-gather a unit just before its forward (the next unit's gather is launched early: prefetch),
              free it right after.
  backward    all-gather it again before its backward (prefetching the unit before it), then, once all its
              gradients exist, reduce-scatter them into the owners' chunks and free the parameters and gradients.
              The reduce-scatter runs while the next unit's gather is waited; that unit's backward starts after
              it, so one unit's full-size gradient buffer is alive at a time.
  step        AdamW on the owned chunks only; nothing is gathered until the next forward.
Owned gradient chunks exist from their unit's first reduce-scatter (whose output becomes the chunk) to the next
step's first forward, which releases them (zero by then): no fp32 gradient memory while a forward runs.
So 3 x params x (dp-1)/dp elements per rank per micro-batch: 1.5 x plain data parallelism.
HSDP (zero.shard_group = "node"): every gather and reduce-scatter runs over the node's dp ranks, and each owned
gradient chunk is all-reduced over the nodes once per step (in the last micro-batch's backward). hpZ (zero.hpz): the forward's all-gather over dp leaves each rank a
secondary copy of its node-local part of the unit, and the backward's all-gather runs inside the node from those
(groups.py has the volumes).

The root unit is gathered when the model's forward starts. It is freed again as soon as backward reaches the
blocks, when no root parameter was saved for backward before or inside a block (checked each forward by a
saved-tensor hook): for a GPT the tied embedding's head matmul is the last reader, and the embedding lookup's
backward needs only the token ids. Otherwise it stays gathered until its gradients are reduced. A parameter
that is at least half of its unit (the tied embedding) sits alone in its bucket, so its autograd gradient is
reduce-scattered as it is, with no full-size copy. Model construction creates only shards: a model built on the
meta device is materialised one unit at a time, so the peak is one full unit, never the full model.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

from megazoo.parallel.collectives import all_gather_flat
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.buckets import build_buckets
from megazoo.parallel.zero.gather.fp8 import Fp8Gather, fp8_gather_problem, fp8_weight_names
from megazoo.parallel.zero.groups import ShardGroups, shard_groups
from megazoo.parallel.zero.quantized import quantized_all_gather
from megazoo.parallel.zero.gather.spare import SpareStorages
from megazoo.parallel.zero.gather.units import InitFn, Named, Unit, materialise
from megazoo.parallel.zero.partitioned import PartitionedOptimizer

UNBOUNDED = 1 << 62
OPS = ("all-gather", "reduce-scatter")  # the collectives whose order the first step verifies


class ZeroStage3(PartitionedOptimizer):
    params_partitioned = True

    def after_load(self) -> None:
        """Loaded shards take effect at the next gather: make sure nothing stale is gathered now."""
        for unit in self.units:
            unit.secondary = None
            if unit.gathered:
                self._free(unit)
        self.spare.clear()
        if self.fp8 is not None:  # the FP8 scales were of the shards before the load (a heal, a resume)
            self.fp8.invalidate()

    def __init__(self, model: nn.Module, named: Named, units: list[nn.Module], topo: Topology, *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, init_fn: InitFn | None = None,
                 check_order: bool = True, offload: str = "none", adamw: Callable | None = None,
                 groups: ShardGroups | None = None, quantized_weights: bool = False, fp8_all_gather: bool = False):
        self.groups = groups = groups or shard_groups(topo)
        self.qwz = quantized_weights  # forward/backward gathers in int8 blocks (quantized.py); never the masters
        self._exact = False  # gathered(): full weights for export / checkpoints, never quantized
        if fp8_all_gather and (why := fp8_gather_problem(model, 3, quantized_weights, groups.hpz)):
            raise ValueError(f"zero.fp8_all_gather = true is unsupported here: {why}")
        fp8_names = fp8_weight_names(model) if fp8_all_gather else set()  # own buckets, gathered as float8
        self.dp_group = groups.shard_group  # dp x cp: every rank holding these parameters; HSDP: the node's
        module_names = {m: n for n, m in model.named_modules()}
        prefixes = [module_names[u] + "." for u in units]
        per_unit: list[Named] = [[] for _ in range(len(units) + 1)]  # the last is the root unit
        for entry in named:
            owner = next((i for i, pre in enumerate(prefixes) if entry[0].startswith(pre)), len(units))
            per_unit[owner].append(entry)
        self.units: list[Unit] = []
        self.spare = SpareStorages(limit=0)  # nothing parked while constructing (one full unit at a time)
        for i, unit_named in enumerate(per_unit):
            unit_named = materialise(model, unit_named, init_fn, topo.device)
            half = sum(p.numel() for _, p, _ in unit_named) / 2  # a parameter this large gets its own bucket
            alone = {name for name, p, _ in unit_named if p.numel() >= half}
            buckets, frozen = (build_buckets(unit_named, groups.shard_size, groups.shard_rank, UNBOUNDED,
                                             group_of=lambda n: n if n in alone else ("fp8" if n in fp8_names else None),
                                             frozen=f)
                               if unit_named else [] for f in (False, True))
            unit = Unit(i, prefixes[i][:-1] if i < len(units) else "<root>", buckets, frozen)
            self.units.append(unit)
            self._free(unit)
        all_buckets = [b for u in self.units for b in u.buckets]
        self.spare.limit = max(sum(b.flat_params.numel() * b.flat_params.element_size() for b in u.buckets + u.frozen)
                               for u in self.units)  # one unit's memory parked between its free and the next gather
        super().__init__(all_buckets, [s for u in self.units for s in u.shards], topo, lr=lr, betas=betas,
                         eps=eps, weight_decay=weight_decay, offload=offload,
                         specs={name: spec for name, _, spec in named}, adamw=adamw, max_in_flight=1,
                         groups=groups)
        self.fp8 = Fp8Gather(self.dp_group, groups.shard_size, self.comm, topo.tp_group) if fp8_names else None
        self._fp8_buckets = {id(b) for b in all_buckets if b.names[0] in fp8_names}
        self._owned_grad_of = {}  # (unit, bucket) -> what the reducer adds the reduced chunk into
        self._key: dict[tuple[int, int], int] = {}
        k = 0
        for u in self.units:
            for j in range(len(u.buckets)):
                # Without offload the owned gradients are released while a step's first forward runs and
                # created by their first reduction (partitioned.accumulate_owned), as FSDP's sharded gradients.
                into = (lambda out, scale, k=k: self.accumulate_owned(k, out, scale)) if offload == "none" \
                    else self.owned_grads[k]
                self._owned_grad_of[(u.index, j)] = into
                self._key[(u.index, j)] = k  # the owned chunk's index (HSDP crosses nodes per chunk, per step)
                k += 1
        self._where = {}
        for u in self.units:
            for j, b in enumerate(u.buckets):
                for p, off in zip(b.params, b.offsets):
                    self._where[p] = (u, j, off)
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.root = self.units[-1]
        self.blocks = self.units[:-1]
        for i, module in enumerate(units):
            module.register_forward_pre_hook(lambda m, args, i=i: self._pre_forward(i))
            module.register_forward_hook(lambda m, args, out, i=i: self._post_forward(i))
            module.register_full_backward_pre_hook(lambda m, grad_out, i=i: self._pre_backward(i))
        model.register_forward_pre_hook(lambda m, args: self._before_model_forward())
        model.register_forward_hook(lambda m, args, out: self._after_model_forward(), always_call=True)
        self._in_backward = False
        self._frozen_pending: list[Unit] = []  # reduced units whose frozen weights backward may still read
        self._saving = None  # the saved-tensor hooks watching root parameters during a forward with grad
        self._root_read = False  # a root parameter was saved for backward since the forward started
        self._root_needed = False  # ... and a block ran after it: its backward reads root parameters mid-way
        self._check_order = check_order  # the first step verifies every dp rank gathers the same units

    # ---- gather / free ------------------------------------------------------------------------------------
    def _verify_same_unit(self, unit: Unit, op: str) -> None:
        """First step only: every dp rank must be at the same (unit, operation), else fail with a message
        instead of hanging or crashing in mismatched collectives. Collective: a tiny all-gather over dp."""
        code = 2 * unit.index + OPS.index(op)
        mine = torch.full((1,), code, dtype=torch.int64, device=self.topo.device)
        everyone = torch.empty(self.groups.shard_size, dtype=torch.int64, device=self.topo.device)
        all_gather_flat(everyone, mine, self.dp_group)
        if (everyone != code).any():
            where = {r: f"{OPS[c % 2]} {self.units[c // 2].name}" for r, c in enumerate(everyone.tolist())}
            raise RuntimeError(f"ZeRO-3: data-parallel ranks run different module sequences (dp rank -> next "
                               f"collective: {where}). Every dp rank must run the same modules in the same order "
                               "and use the same parameters (no rank-dependent control flow around sharded "
                               "modules)")

    def _gather(self, unit: Unit, wait: bool = True) -> None:
        if not unit.gathered and not unit.works:
            if self._check_order and self.dp_group is not None:
                self._verify_same_unit(unit, "all-gather")
            # hpZ: in backward (and a checkpointed block's recomputation) from the node's secondaries
            from_node = self.groups.hpz and self._in_backward and unit.secondary is not None
            group = self.groups.secondary_group if from_node else self.dp_group
            shards = unit.secondary if from_node else unit.shards + unit.frozen_shards  # (frozen: LoRA's base)
            for b, shard in zip(unit.buckets + unit.frozen, shards):
                flat = b.flat_params
                self.spare.fill(flat.untyped_storage(), flat.numel() * flat.element_size())
                if group is None:
                    flat.copy_(shard)
                elif id(b) in self._fp8_buckets and not self._exact:
                    unit.works.append(self.fp8.gather(b, flat, shard))
                elif self.qwz and not from_node and not self._exact:
                    unit.works.append(quantized_all_gather(flat, shard, group, self.groups.shard_size,
                                                           ledger=self.comm))
                else:
                    unit.works.append(all_gather_flat(flat, shard, group, async_op=True, ledger=self.comm))
            unit.capture = self.groups.hpz and not from_node
            if not unit.works:
                self._gathered(unit)
        if wait and unit.works:
            self._timed_wait(unit.works)
            unit.works.clear()
            self._gathered(unit)

    def _gathered(self, unit: Unit) -> None:
        """The unit's full parameters are in place; hpZ keeps this rank's node-local part of a primary gather."""
        unit.gathered = True
        if unit.capture:
            n, r = self.groups.secondary_size, self.groups.secondary_rank
            unit.secondary = [b.flat_params.view(n, -1)[r].clone() for b in unit.buckets + unit.frozen]
            unit.capture = False

    def _free(self, unit: Unit) -> None:
        if unit.works:  # finish a prefetch in flight before freeing its buffer
            self._timed_wait(unit.works)
            unit.works.clear()
            self._gathered(unit)
        for b in unit.buckets + unit.frozen:
            self.spare.free(b.flat_params.untyped_storage())
        unit.gathered = False

    def _pre_forward(self, i: int) -> None:
        self._root_needed |= self._root_read and not self._in_backward
        self._gather(self.blocks[i])
        if i + 1 < len(self.blocks) and not self._in_backward:
            self._gather(self.blocks[i + 1], wait=False)  # prefetch: overlaps this block's compute

    def _post_forward(self, i: int) -> None:
        if not self._in_backward:  # during backward this forward is a checkpoint recomputation: keep it
            self._root_needed |= self._root_read
            self._free(self.blocks[i])

    def _pre_backward(self, i: int) -> None:
        if not self._in_backward and not self._root_needed and self.root.gathered:
            # Autograd runs every operation recorded after the last block before any block's backward, so
            # the root's readers are done: free it now, not when its gradients arrive at the very end.
            self._free(self.root)
        self._in_backward = True
        while self._frozen_pending:
            self._free(self._frozen_pending.pop())
        self._gather(self.blocks[i])
        # The unit after this one (in forward order) launched its reduce-scatter when its gradients were done
        # (it overlapped the wait above); finish it before this unit's backward allocates gradients and before
        # the prefetch below allocates the previous unit: its buffer is then reused, never held beside them.
        self.reducer.finish_launched()
        if i > 0:
            self._gather(self.blocks[i - 1], wait=False)

    def _before_model_forward(self) -> None:
        # A new micro-batch starts (a checkpointed block's recomputation re-runs that block only, never the
        # model): from here block forwards free their units again.
        self._in_backward = False
        self._root_read = self._root_needed = False
        if torch.is_grad_enabled() and self.grads_clean and self.offload == "none":
            self.release_owned_grads()  # a step's first micro-batch: nothing to accumulate into yet
        if torch.is_grad_enabled() and self._saving is None:
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._saving.__enter__()
        self._gather(self.root)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Saved-tensor hook (forward only): notes when a root parameter (or a view of one) is saved."""
        if not self._root_read and t.untyped_storage()._cdata in self.root.storages:
            self._root_read = True
        return t

    def _after_model_forward(self) -> None:
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None
        if not torch.is_grad_enabled():  # no backward will follow (evaluation, generation)
            self._free(self.root)
            self.spare.clear()
            for unit in self.units:
                unit.secondary = None

    # ---- gradients ----------------------------------------------------------------------------------------
    def begin_micro_batch(self, last: bool) -> None:
        """Stage 3 reduces every micro-batch; `last` says whether HSDP's reductions cross nodes in it."""
        self._in_backward = False
        self.reducer.cross_now = last
        for u in self.units:
            u.ready = 0

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        unit, j, off = self._where[param]
        bucket = unit.buckets[j]
        grad = param.grad
        if all(f is None for f in unit.grad_flats):
            # This unit's first gradient: finish the previous unit's reduce-scatter (it overlapped this unit's
            # all-gather wait and first backward op) so its buffer is reused, not held next to a second one.
            self.reducer.finish_launched()
            self._take_grad_flats(unit)
        if (unit.grad_flats[j] is None and len(bucket.params) == 1 and bucket.numel == grad.numel()
                and grad.is_contiguous() and grad.dtype == bucket.dtype):
            # A parameter alone in its bucket (the tied embedding): autograd's gradient is this bucket's flat
            # gradient already; the reducer holds it until reduced (the pool does not know it: give() ignores it)
            unit.grad_flats[j] = grad.detach().view(-1)
        else:
            if unit.grad_flats[j] is None:  # uninitialised: every range is written below or zeroed at launch
                unit.grad_flats[j] = self.reducer.pool.take(bucket.numel, bucket.dtype, param.device)
            unit.grad_flats[j][off:off + param.numel()].copy_(grad.view(-1))
        unit.got[j].add(off)
        param.grad = None
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._reduce_and_free(unit)

    def _take_grad_flats(self, unit: Unit) -> None:
        """A unit's full-size gradient buffers, largest first, when its first gradient arrives. In arrival order
        the small bucket (biases, norms) came first and missed the pool, and a miss releases the free buffers:
        the block-size one the previous unit gave back, so every block allocated (and page-faulted) its own.
        A one-parameter bucket waits: its gradient may become the flat buffer itself (no copy)."""
        for j in sorted(range(len(unit.buckets)), key=lambda j: -unit.buckets[j].numel):
            b = unit.buckets[j]
            if unit.grad_flats[j] is None and len(b.params) > 1:
                unit.grad_flats[j] = self.reducer.pool.take(b.numel, b.dtype, b.flat_params.device)

    def _reduce_and_free(self, unit: Unit) -> None:
        if self._check_order and self.dp_group is not None:
            self._verify_same_unit(unit, "reduce-scatter")
        if unit is self.root:  # the blocks' backward is over: their buffers are not reused before the step
            self.reducer.finish_launched()
            self.reducer.pool.clear()
        for j, b in enumerate(unit.buckets):
            flat = unit.grad_flats[j]
            if flat is None:  # no gradient reached this bucket
                flat = self.reducer.pool.take(b.numel, b.dtype, b.flat_params.device)
            flat[b.offsets[-1] + b.params[-1].numel():].zero_()  # padding; below: parameters without a gradient
            for p, off in zip(b.params, b.offsets):
                if off not in unit.got[j]:
                    flat[off:off + p.numel()].zero_()
            unit.got[j].clear()
            # The reducer owns the buffer from here and gives it back to the pool when the reduction is done.
            unit.grad_flats[j] = None
            self.reducer.launch(flat, self._owned_grad_of[(unit.index, j)],
                                on_done=lambda flat=flat: self.reducer.pool.give(flat), key=self._key[(unit.index, j)])
        unit.ready = -1  # reduced for this micro-batch
        unit.secondary = None  # hpZ: the next forward gathers (and keeps) fresh ones
        if unit.frozen and unit is not self.root:
            # Its frozen weights may still be read by this unit's backward (dx = g W) after the last trainable
            # gradient (LoRA's) is done: freed when the previous unit's backward starts (its output gradient
            # needs all of this unit's), or at the end of backward.
            self._frozen_pending.append(unit)
        else:
            self._free(unit)

    def finish_gradients(self) -> None:
        for unit in self.units:
            if unit.ready >= 0 and unit.buckets:  # unused parameters: reduce zeros, on every rank alike
                self._reduce_and_free(unit)
            elif not unit.buckets and unit.gathered:  # all frozen: no gradient frees it, so free it here
                self._free(unit)
        while self._frozen_pending:
            self._free(self._frozen_pending.pop())
        self.reducer.drain()
        self.spare.clear()  # nothing transient is held between steps
        self._in_backward = False

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for unit in self.units:
            unit.secondary = None  # hpZ: stale once the parameters change
        if self.fp8 is not None:
            self.fp8.invalidate()
        self.update_owned(lr)
        for k, shard in enumerate(self.shards):  # every unit's shards, in the masters' order
            self.write_owned(k, shard)
        self._check_order = False

    @contextlib.contextmanager
    def gathered(self):
        """Every unit's full parameters, for reading full weights (export, tests); freed again afterwards. Exact
        under qwZ: a unit gathered in int8 blocks is gathered again in full precision."""
        self._exact = True
        try:
            for unit in self.units:
                if (self.qwz or self.fp8) and unit.gathered:
                    self._free(unit)
                self._gather(unit)
            yield
        finally:
            self._exact = False
            for unit in self.units:
                self._free(unit)
            self.spare.clear()

    def memory_bytes(self) -> dict[str, int]:
        params = sum(s.numel() * s.element_size() for u in self.units for s in u.shards + u.frozen_shards)
        params += sum(b.flat_params.untyped_storage().nbytes()  # gathered right now
                      for u in self.units for b in u.buckets + u.frozen)
        params += sum(s.numel() * s.element_size() for u in self.units for s in u.secondary or [])  # hpZ
        params += self.spare.nbytes()
        grads = self.owned_grad_bytes() + self.reducer.in_flight_bytes()  # grad_flats are in the reducer's pool
        return {"params": params, "grads": grads, "optimizer": self.optimizer_bytes()}
