"""What every ZeRO stage shares: owned fp32 chunks, their optimizer, the gradient reducer, norm and clipping.

Each stage lays parameters out in flat dp-partitioned buckets (buckets.py). A rank owns one chunk of each
bucket and keeps for it an fp32 master copy, an fp32 gradient accumulator and the AdamW moments: the optimizer
never sees a full parameter. When the parameters are already fp32 (or fp64) and the states stay on the device,
the master IS the owned parameter chunk (an alias, not a copy): AdamW updates the chunk in place, and the model
states are the plain fp32 Adam 4 + 4 + 8 bytes per parameter (planner.FP32_ADAM), not 4 + 4 + 12. How gradients reach the owned chunks and how parameters come back differ per stage
(stage12.py, stage3.py).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megazoo.parallel import accelerator
from megazoo.parallel.checkpoint.views import StateView, ensure_adam_state
from megazoo.parallel.collectives import CommLedger, all_reduce, reduce_scatter_flat
from megazoo.parallel.simulation.fake_world import same_memory
from megazoo.parallel.grad_norm import flat_grad_norm
from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.buckets import Bucket, BufferPool
from megazoo.parallel.zero.groups import ShardGroups, shard_groups
from megazoo.parallel.zero.qgz import HierarchicalReduce

MAX_REDUCTIONS_IN_FLIGHT = 2  # full-size gradient buffers alive at once while reductions overlap backward
# (stages 1-2: buckets of reduce_bucket_size; stage 3 passes 1: its buckets are whole units, e.g. a transformer
# block, so each one in flight is a block's full gradient plus its reduce-scatter output)


@dataclass(frozen=True)
class TiedParameters:
    """Parameters held by two pipeline stages (the input and output embedding): their gradients are summed over
    `group` every step so both copies stay equal, and they count in the gradient norm on one stage only."""

    names: frozenset[str] = frozenset()
    group: object = None  # the process group joining the holders; None: nothing to sum
    counted_in_norm: bool = True


class GradientReducer:
    """Reduce-scatters full-size gradient buffers over dp, asynchronously, into owned fp32 chunks.

    Collective: reduce-scatter (sum) over dp per launched buffer; the owner then divides by dp. HSDP (`replicas`
    > 1: the group is one node's dp ranks): the owned chunk is all-reduced (sum) over `replica_group`, the same
    chunk's owners on the other nodes, and divided by dp = size x replicas, once per optimizer step: the node's
    sums of every micro-batch accumulate in the owned chunk first. In the step's last backward (`cross_now`, set
    by the stage's begin_micro_batch(last=True)) each chunk crosses as soon as its last reduction is added, so
    the cross-node all-reduce overlaps that backward; a chunk with one contribution in the step (no gradient
    accumulation) crosses as the reduce-scatter's output, in the reduction's dtype (bf16: half the bytes of the
    fp32 owned chunk). What has not crossed by `drain()` (no begin_micro_batch(last=True), ZeRO-Offload's host
    chunks) crosses there. `owned_of(key)` is the owned chunk a launch with that key accumulates into.
    At most MAX_REDUCTIONS_IN_FLIGHT buffers are in flight: launching another first finishes the oldest, so the
    full-size buffers are freed during backward, not all at its end.
    """

    def __init__(self, group, dp: int, ledger: CommLedger, max_in_flight: int = MAX_REDUCTIONS_IN_FLIGHT, *,
                 replica_group=None, replicas: int = 1, hierarchical: HierarchicalReduce | None = None,
                 owned_of: Callable[[int], torch.Tensor | None] | None = None, device: torch.device | None = None):
        self.group, self.dp, self.ledger, self.max_in_flight = group, dp, ledger, max_in_flight
        self.hierarchical = hierarchical  # qgZ: quantized all-to-all in the node, then across nodes (qgz.py)
        self.replica_group = replica_group
        self.owned_of, self.device = owned_of, device  # HSDP: the owned chunk of a key; where NCCL reduces it
        self.cross_now = False  # HSDP: the coming backward is the step's last; its reductions cross nodes at once
        self._added: set[int] = set()  # keys whose owned chunk received a reduction since the last drain
        self._crossed: set[int] = set()  # ... and already all-reduced over the replicas
        self.scale = 1.0 / (dp * replicas)  # the mean over every rank holding these parameters
        self.pool = BufferPool()  # this step's full-size gradient buckets (stages 2-3) and reduce-scatter outputs
        self._pending: deque = deque()
        self._host_adds: deque = deque()  # ZeRO-Offload: (event, pinned staging, owned CPU chunk) not yet added

    def launch(self, flat: torch.Tensor, owned_grad: torch.Tensor | Callable[[torch.Tensor, float], object],
               on_done: Callable[[], object] | None = None, key: int | None = None) -> None:
        """Reduce-scatter `flat` into `owned_grad` (+=, divided by dp); `flat` must not be written until done.
        `owned_grad` may be a function(sum, 1 / dp) that accumulates the reduced chunk itself (stage 3 creates
        its owned gradients at their first reduction); it returns True when it kept `sum` (taken from the pool).
        `key`: which owned chunk (`owned_of`) this is, for HSDP's once-per-step crossing of the nodes."""
        while len(self._pending) >= self.max_in_flight:
            self._finish_oldest()
        out = self.pool.take(flat.numel() // self.dp, flat.dtype, flat.device)
        if self.group is None:
            out.copy_(flat)
            work = None
        elif self.hierarchical is not None:
            work = self.hierarchical.launch(out, flat)
        else:
            work = reduce_scatter_flat(out, flat, self.group, async_op=True, ledger=self.ledger)
        self._pending.append((work, out, owned_grad, on_done, key, self.cross_now))

    def _finish_oldest(self) -> None:
        work, out, owned_grad, on_done, key, cross = self._pending.popleft()
        if work is not None:
            work.wait()
        hsdp = self.replica_group is not None
        if hsdp and key is None:
            raise ValueError("HSDP: a gradient reduction launched without the key of its owned chunk")
        if hsdp and cross and key not in self._added:  # the step's only contribution: cross as it is
            all_reduce(out, self.replica_group, ledger=self.ledger)
            self._crossed.add(key)
        host = not callable(owned_grad) and out.device != owned_grad.device and out.device.type == "cuda"
        if host:
            # ZeRO-Offload: copy the reduced chunk into pinned host memory without blocking the backward that
            # called us; the CPU add happens once the copy's event has completed (at the latest in drain()).
            staging = accelerator.pinned_empty(out.shape, out.dtype)
            staging.copy_(out, non_blocking=True)
            event = accelerator.copy_event(out.device)
            self._host_adds.append((event, staging, owned_grad))
            # `out` goes back to the pool at once: its next user (a reduce-scatter into it, or a copy) is queued
            # behind this copy on the device (NCCL's stream waits for the current one at launch), as the caching
            # allocator lets a freed block be reused. Kept until the step's end (it was), every bucket's
            # reduce-scatter output stayed on the device: +0.70 MB of 3.78 (+19%) in the fake-CUDA dry run of
            # tests/recipes/planner/test_dry_run_cuda.py's offload config.
            self.pool.give(out)
        elif callable(owned_grad):
            if not owned_grad(out, self.scale):
                self.pool.give(out)
        else:
            owned_grad.add_(out.to(owned_grad.device, owned_grad.dtype), alpha=self.scale)
            self.pool.give(out)
        if key is not None:
            self._added.add(key)
        if hsdp and cross and not host and key not in self._crossed:  # the last micro-batch's sum is in: cross
            self._cross(key)
        if on_done is not None:
            on_done()
        self._add_copied(block=False)

    def _cross(self, key: int) -> None:
        """HSDP: all-reduce (sum) owned chunk `key` over the replicas, on the device (offloaded chunks go there
        and back: NCCL reduces device memory only)."""
        owned = self.owned_of(key)
        if owned is not None:
            on_device = owned.to(self.device) if self.device is not None else owned
            all_reduce(on_device, self.replica_group, ledger=self.ledger)
            if on_device is not owned:
                owned.copy_(on_device)
        self._crossed.add(key)

    def _add_copied(self, block: bool) -> None:
        while self._host_adds and (block or self._host_adds[0][0].query()):
            event, staging, owned_grad = self._host_adds.popleft()
            event.synchronize()
            owned_grad.add_(staging.to(owned_grad.dtype), alpha=self.scale)

    def finish_launched(self) -> None:
        """Wait for every launched reduction and add it into its owned chunk (their buffers go back to the pool)."""
        while self._pending:
            self._finish_oldest()

    def in_flight_bytes(self) -> int:
        """The pool (full-size buckets being filled or reduced, reduce-scatter outputs) and offload staging."""
        return self.pool.nbytes() + sum(item[1].numel() * item[1].element_size() for item in self._host_adds)

    def drain(self) -> None:
        while self._pending:
            self._finish_oldest()
        self._add_copied(block=True)
        if self.replica_group is not None:  # HSDP: every chunk not yet crossed this step (same keys on replicas)
            for key in sorted(self._added - self._crossed):
                self._cross(key)
        self._added.clear()
        self._crossed.clear()
        self.pool.clear()  # nothing transient is held between steps


def host_tensor(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A CPU tensor, page-locked when `pin` (so host <-> GPU copies are asynchronous DMA). Pinned with
    cudaHostRegister on exactly its own bytes: torch's pinned allocator rounds every block up to a power of two,
    which for ZeRO-Offload's fp32 masters and moments can cost up to 2x the host memory they need."""
    tensor = torch.empty(shape, dtype=dtype)
    return accelerator.pin_in_place(tensor) if pin else tensor


class PartitionedOptimizer:
    """AdamW over the owned chunks of `buckets`, with the gradient norm computed across dp and tp.

    With `offload="cpu"` (ZeRO-Offload) the fp32 masters, owned gradients and Adam moments live in CPU memory
    (pinned when CUDA is present, so the copies are asynchronous DMA) and the AdamW update runs on the CPU;
    only the updated chunk, cast to the model's dtype, goes back to the device.
    """

    params_partitioned = False  # stage 3: parameters live only as owned chunks (`shards`)

    def __init__(self, buckets: list[Bucket], shards: list[torch.Tensor], topo: Topology, *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, offload: str = "none",
                 tied: TiedParameters = TiedParameters(), specs: dict[str, ShardSpec] | None = None,
                 adamw: Callable | None = None, max_in_flight: int = MAX_REDUCTIONS_IN_FLIGHT,
                 groups: ShardGroups | None = None):
        if offload not in ("none", "cpu"):
            raise ValueError(f"zero.offload = {offload!r} is invalid; valid: 'none', 'cpu'")
        self.groups = groups or shard_groups(topo)  # flat: dp x cp; HSDP: the node's dp ranks (groups.py)
        self.topo, self.group = topo, self.groups.shard_group
        self.buckets = buckets
        self.shards = shards
        self.specs = specs or {}
        self.tied = tied
        # A tied parameter sits alone in its bucket (build_buckets' group_of), so the owned chunks line up.
        self.tied_buckets = [i for i, b in enumerate(buckets) if set(b.names) & tied.names]
        assert all(set(buckets[i].names) <= tied.names for i in self.tied_buckets), "tied parameters need own buckets"
        self.comm = CommLedger(node_size=topo.node_size)  # bytes per link class once the node size is known
        self.offload = offload
        state_device = torch.device("cpu") if offload == "cpu" else topo.device
        pin = offload == "cpu" and topo.device.type == "cuda"
        # fp32 masters of the owned chunks (fp64 when the model is fp64, for parity tests), and their gradients.
        # An fp32/fp64 chunk on the state device is its own master (aliased: updated in place, never copied).
        self.masters, self.owned_grads = [], []
        self.aliased = offload == "none" and all(torch.promote_types(s.dtype, torch.float32) == s.dtype
                                                 and s.device == state_device for s in shards)
        for s in shards:
            dtype = torch.promote_types(s.dtype, torch.float32)
            if offload == "cpu":
                master, grad = host_tensor(s.shape, dtype, pin), host_tensor(s.shape, dtype, pin).zero_()
            else:
                master = s.detach() if self.aliased else torch.empty(s.shape, dtype=dtype, device=state_device)
                grad = torch.zeros(s.shape, dtype=dtype, device=state_device)
            self.masters.append(master if self.aliased else master.copy_(s.detach()))
            self.owned_grads.append(grad)
        for master, grad in zip(self.masters, self.owned_grads):
            master.grad = grad
        self.grads_clean = True  # every owned gradient is zero (stage 3 may then release them)
        groups = [{"params": [m for m, b in zip(self.masters, buckets) if b.weight_decay],
                   "weight_decay": weight_decay},
                  {"params": [m for m, b in zip(self.masters, buckets) if not b.weight_decay],
                   "weight_decay": 0.0}]
        adamw = adamw or torch.optim.AdamW  # kernels' adamw op: reference loop, foreach, torch fused or apex
        self.optimizer = adamw([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
        bits = self.groups.quantized_gradients  # qgZ replaces the flat reduce-scatter over dp
        hierarchical = None if bits == "none" else HierarchicalReduce(
            topo.dp_intra_group, topo.dp_inter_group, topo.dp // topo.dp_nodes, topo.dp_nodes, bits, self.comm)
        self.reducer = GradientReducer(self.group, self.groups.shard_size, self.comm, max_in_flight,
                                       replica_group=self.groups.replica_group, replicas=self.groups.replica_size,
                                       hierarchical=hierarchical, owned_of=lambda k: self.owned_grads[k],
                                       device=topo.device)
        self.wait_s: dict[str, float] = defaultdict(float)  # host seconds waiting on all-gathers (benchmarks)

    def _timed_wait(self, works: list, kind: str = "all-gather") -> None:
        if not works:
            return
        start = time.perf_counter()
        for work in works:
            work.wait()
        self.wait_s[kind] += time.perf_counter() - start

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm: one fused norm per owned chunk. Owned chunks partition every bucket: sum over dp (HSDP:
        over the node only; the other nodes hold the same chunks).
        tp-sharded buckets also sum over tp; replicated ones are counted once. Collectives: one all-reduce over
        dp, one over tp, one over pp."""
        parts = [(g, b.tp_sharded) for i, (b, g) in enumerate(zip(self.buckets, self.owned_grads))
                 if g is not None and (i not in self.tied_buckets or self.tied.counted_in_norm)]
        return flat_grad_norm(parts, self.topo, self.group, ledger=self.comm)

    @torch.no_grad()
    def sum_tied_gradients(self) -> None:
        """Sum the owned chunks of tied parameters over their group (first + last pipeline stage)."""
        if self.tied.group is not None:
            for i in self.tied_buckets:
                grad = self.owned_grads[i]
                on_device = grad.to(self.topo.device)  # under ZeRO-Offload it lives on the CPU; NCCL needs GPU
                dist.all_reduce(on_device, group=self.tied.group)
                if on_device is not grad:
                    grad.copy_(on_device)

    def gradients(self) -> list[torch.Tensor]:
        return [g for g in self.owned_grads if g is not None]

    def accumulate_owned(self, k: int, reduced: torch.Tensor, scale: float) -> bool:
        """owned_grads[k] += reduced * scale, creating it (in the master's dtype) when it was released: then the
        reduce-scatter output itself becomes the owned gradient when the pool lets it go. True when kept."""
        grad, kept = self.owned_grads[k], False
        if grad is None:
            kept = reduced.dtype == self.masters[k].dtype and self.reducer.pool.release(reduced)
            grad = (reduced if kept else reduced.to(self.masters[k].dtype, copy=True)).mul_(scale)  # = 0 + s x r
            self.owned_grads[k] = self.masters[k].grad = grad
        else:
            grad.add_(reduced.to(grad.dtype), alpha=scale)
        self.grads_clean = False
        return kept

    def release_owned_grads(self) -> None:
        """Free the (zero) owned gradients until the next reduction creates them (stage 3, no offload)."""
        for k, master in enumerate(self.masters):
            master.grad = self.owned_grads[k] = None

    def zero_grads_(self) -> None:
        """Drop this step's gradients (a step skipped on overflow)."""
        for g in self.gradients():
            g.zero_()
        self.grads_clean = True

    @torch.no_grad()
    def clip_(self, total_norm: torch.Tensor, max_norm: float) -> None:
        """Scale every owned gradient by min(1, max_norm / norm). The factor is moved once per (device, dtype):
        under ZeRO-Offload the gradients are on the host and the norm on the GPU, and a move per bucket was one
        blocking device-to-host copy each (found on fake CUDA)."""
        coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        moved: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        for g in self.gradients():
            key = (g.device, g.dtype)
            if key not in moved:
                moved[key] = coef.to(g.device, g.dtype)
            g.mul_(moved[key])

    @torch.no_grad()
    def update_owned(self, lr: float) -> None:
        """AdamW on the owned fp32 chunks, then clear the gradients; write_owned puts each into the model."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for g in self.gradients():
            g.zero_()
        self.grads_clean = True

    @torch.no_grad()
    def write_owned(self, k: int, target: torch.Tensor) -> None:
        """Bucket k's updated master into `target` (its owned parameters), cast to their dtype and device there.
        One bucket at a time: casting every master first held a 16-bit copy of all owned parameters at once
        (gpt-1t's last stage: +2.5 GB at the step's end, found by the dry run). fp32 on the device: the master is
        the owned chunk itself, nothing to copy."""
        master = self.masters[k]
        if not same_memory(master, target):
            target.copy_(master, non_blocking=True)

    def state_views(self) -> list[StateView]:
        """This rank's owned chunks (fp32 masters, Adam moments; stage 3 also the parameters) and, for stages
        1-2, the full parameters (written by dp rank 0 only), as flat views for checkpointing."""
        ensure_adam_state(self.optimizer, self.masters)
        views = []
        for i, b in enumerate(self.buckets):
            s, e = b.owned.start, b.owned.stop
            state = self.optimizer.state[self.masters[i]]
            owned = [("master", self.masters[i]), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])]
            if self.params_partitioned:
                owned.append(("param", self.shards[i]))
            for name, p, off in zip(b.names, b.params, b.offsets):
                spec, n = self.specs[name], p.numel()
                lo, hi = max(off, s), min(off + n, e)
                if lo < hi:
                    views += [StateView(name, spec, kind, lo - off, hi - off, t[lo - s:hi - s],
                                        write=self.groups.replica_rank == 0) for kind, t in owned]  # HSDP: node 0
                if not self.params_partitioned:
                    views.append(StateView(name, spec, "param", 0, n, b.flat_params[off:off + n],
                                           write=self.topo.grad_rank == 0))
        return views

    def optimizer_bytes(self) -> int:
        """Adam moments, plus the fp32 masters unless they alias the owned parameter chunks (counted there)."""
        total = 0 if self.aliased else sum(m.numel() * m.element_size() for m in self.masters)
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim())
        return total

    def owned_grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.gradients())
