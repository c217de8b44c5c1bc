"""ZeRO stages 1 and 2: optimizer states (1) and gradients (2) partitioned over the data-parallel group.

Every dp rank keeps full parameters (in flat buckets, parallel/zero/buckets.py) but fp32 master weights and
Adam moments only for the chunk of each bucket it owns. One step:

  backward    gradient hooks fill buckets; a full bucket's gradient is reduce-scattered (sum) over dp into the
              owner's chunk, asynchronously, while backward continues.
              stage 1: gradients accumulate in full-size buffers over the micro-batches and reduce once, during
                       the last micro-batch's backward.
              stage 2: every micro-batch reduces; the full-size bucket buffer is freed once its reduce-scatter
                       is done, so a rank holds only its owned fp32 gradient chunk between micro-batches.
  step        global grad norm over owned chunks (all-reduce over dp, then over tp for sharded buckets), clip,
              AdamW on the owned fp32 chunks, cast back into the bucket, all-gather each bucket over dp.

Collectives per step, per bucket: one reduce-scatter (stage 2: per micro-batch) and one all-gather over dp:
the same 2 x params x (dp-1)/dp elements per rank as plain data parallelism's all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.collectives import all_gather_flat, reduce_scatter_flat
from parallel.tensor import ShardSpec
from parallel.topology import Topology
from parallel.zero.buckets import DEFAULT_BUCKET_ELEMENTS, Bucket, build_buckets


class ZeroStage12:
    """Wraps a model's parameters; replaces the dp all-reduce and the optimizer of plain data parallelism."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter, ShardSpec]], topo: Topology, *, stage: int,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS):
        if stage not in (1, 2):
            raise ValueError(f"ZeroStage12 implements zero stage 1 or 2, not {stage}")
        self.stage, self.topo = stage, topo
        self.group = topo.dp_group
        self.buckets = build_buckets(named, topo.dp, topo.dp_rank, bucket_elements)
        # fp32 masters (fp64 when the model is fp64, for parity tests)
        self.masters = [b.flat_params[b.owned].detach().to(torch.promote_types(b.dtype, torch.float32), copy=True)
                        for b in self.buckets]
        self.owned_grads = [torch.zeros_like(m) for m in self.masters]
        for master, grad in zip(self.masters, self.owned_grads):
            master.grad = grad
        groups = [{"params": [m for m, b in zip(self.masters, self.buckets) if b.weight_decay],
                   "weight_decay": weight_decay},
                  {"params": [m for m, b in zip(self.masters, self.buckets) if not b.weight_decay],
                   "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
        # stage 1 keeps full-size gradient buffers for the whole step; stage 2 allocates one per reduction.
        self.full_grads: list[torch.Tensor | None] = [
            torch.zeros(b.numel, dtype=b.dtype, device=b.flat_params.device) if stage == 1 else None
            for b in self.buckets]
        self._ready = [0] * len(self.buckets)
        self._launched: set[int] = set()
        self._pending: list[tuple[int, torch.Tensor, object]] = []
        self._reduce_now = True
        self._where = {}
        for i, b in enumerate(self.buckets):
            for p, off in zip(b.params, b.offsets):
                self._where[p] = (i, off)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if stage == 1:
            self._attach_grad_views()

    # ---- backward ----------------------------------------------------------------------------------------
    def _attach_grad_views(self) -> None:
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
        bucket, flat = self.buckets[i], self.full_grads[i]
        if flat is None:  # stage 2, no parameter of this bucket received a gradient in this backward
            flat = self.full_grads[i] = torch.zeros(bucket.numel, dtype=bucket.dtype,
                                                    device=bucket.flat_params.device)
        self._launched.add(i)
        out = torch.empty(bucket.chunk, dtype=bucket.dtype, device=flat.device)
        if self.group is None:
            out.copy_(flat)
            work = None
        else:
            work = reduce_scatter_flat(out, flat, self.group, async_op=True)
        self._pending.append((i, out, work))

    def finish_gradients(self) -> None:
        """Wait for every reduce-scatter of this step; owned_grads then hold the dp-mean gradient chunk."""
        if self._reduce_now:  # buckets with unused parameters never filled: reduce them now, on every rank alike
            for i in range(len(self.buckets)):
                if i not in self._launched:
                    self._launch_reduce(i)
        for i, out, work in self._pending:
            if work is not None:
                work.wait()
            self.owned_grads[i].add_(out.to(self.owned_grads[i].dtype), alpha=1.0 / self.topo.dp)
            if self.stage == 2:
                self.full_grads[i] = None
            else:
                self.full_grads[i].zero_()
        self._pending.clear()

    # ---- step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm: owned chunks partition each bucket (sum over dp); tp-sharded buckets also sum over
        tp, replicated ones are counted once. Collectives: one all-reduce over dp, one over tp."""
        dtype = torch.float64 if any(m.dtype == torch.float64 for m in self.masters) else torch.float32
        sq = torch.zeros(2, dtype=dtype, device=self.topo.device)  # [sharded, replicated]
        for b, g in zip(self.buckets, self.owned_grads):
            sq[0 if b.tp_sharded else 1] += g.to(dtype).pow(2).sum()
        if self.group is not None:
            dist.all_reduce(sq, group=self.group)
        if self.topo.tp_group is not None:
            sharded = sq[:1].clone()
            dist.all_reduce(sharded, group=self.topo.tp_group)
            sq[0] = sharded[0]
        return sq.sum().sqrt()

    @torch.no_grad()
    def clip_(self, total_norm: torch.Tensor, max_norm: float) -> None:
        coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        for g in self.owned_grads:
            g.mul_(coef.to(g.dtype))

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """AdamW on the owned chunks, then all-gather every bucket's parameters over dp."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for b, master, grad in zip(self.buckets, self.masters, self.owned_grads):
            owned = master.to(b.dtype)
            b.flat_params[b.owned].copy_(owned)
            if self.group is not None:
                all_gather_flat(b.flat_params, owned, self.group)
            grad.zero_()

    # ---- accounting ----------------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states (fp32 masters + Adam moments)."""
        params = sum(b.flat_params.numel() * b.flat_params.element_size() for b in self.buckets)
        grads = sum(g.numel() * g.element_size() for g in self.owned_grads)
        grads += sum(f.numel() * f.element_size() for f in self.full_grads if f is not None)
        states = sum(m.numel() * m.element_size() for m in self.masters)
        for state in self.optimizer.state.values():
            states += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim())
        return {"params": params, "grads": grads, "optimizer": states}
