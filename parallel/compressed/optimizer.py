"""CompressedAdam: 1-bit Adam and 0/1 Adam as a ZeRO stage-0 optimizer (the ZeroOptimizer interface).

One step (see schedule.py for which kind a step is; comms.py for the compressed all-reduce):

  warm-up ("adamw")  exactly stage 0: the backward hooks all-reduce the gradient buckets in full precision, and
                     the kernels' AdamW updates parameters whose moments are views into this class's flat buffers.
  1-bit Adam         backward leaves local gradients (no all-reduce). m = b1 m + (1 - b1) g_local, then m is
                     replaced by its compressed average (one all-to-all + one all-gather of sign bits, error
                     feedback on worker and server); v stays frozen at freeze_step; p -= lr (m / bc1) / (sqrt(v /
                     bc2) + eps) after the decoupled decay p *= 1 - lr wd (2-D parameters only, as AdamW).
  0/1 Adam           "var" steps: full all-reduce, m and v updated; "onebit_grad": g compressed-averaged, m only;
                     "local": m and p from the local gradient, nothing sent; "sync": after the local step, each
                     rank's accumulated update d = (p - anchor) (sqrt(v / bc2) + eps) is compressed-averaged,
                     p = anchor + d_avg / (sqrt(v / bc2) + eps) and m = -d_avg / (sum of lr / bc1 since the last
                     sync): identical on every rank again. The anchor is p at the last sync with the (identical)
                     weight decay applied since, so the decay never enters the communicated update.

Collectives per step: warm-up/"var": one all-reduce per bucket (stage 0's); "onebit"/"onebit_grad"/"sync": per
bucket one all-to-all and one all-gather of uint8; "local": none. Gradient norm and clipping are stage 0's, on the
gradients this rank holds (after warm-up: its local ones, so clipping is per rank).

Memory beyond stage 0: the parameters move into flat buckets padded to 8 x dp (no copy kept), moments padded alike,
a worker error (bucket size) and a server error (bucket / dp) per bucket; 0/1 Adam adds a padded work buffer per
bucket, and an anchor per bucket from var_freeze_step on.
"""

from __future__ import annotations

import torch

from megazoo.parallel.checkpoint.views import optimizer_steps, set_optimizer_steps
from megazoo.parallel.compressed.comms import compressed_all_reduce, padded_numel
from megazoo.parallel.compressed.schedule import CompressionSettings, Schedule
from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.partitioned import TiedParameters
from megazoo.parallel.zero.stage0 import DataParallelAdamW


class CompressedAdam(DataParallelAdamW):
    def __init__(self, named: list[tuple[str, torch.nn.Parameter, ShardSpec]], topo: Topology, *,
                 settings: CompressionSettings, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, tied: TiedParameters = TiedParameters(), adamw=None, bucket_elements: int):
        if tied.group is not None:
            raise ValueError(f"{settings.name} does not support tied parameters across pipeline stages (pp > 1)")
        super().__init__(named, topo, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, tied=tied,
                         adamw=adamw, bucket_elements=bucket_elements)
        self.settings, self.schedule = settings, Schedule(settings)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.steps = 0  # optimizer steps taken (the torch optimizer's per-tensor "step" mirrors it)
        world = self.reducer.size
        on_device = self.optimizer.defaults.get("fused") or self.optimizer.defaults.get("capturable")
        decayed = {p for g in self.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
        self.param_flats, self.param_padded, self.m, self.v, self.decayed = [], [], [], [], []
        self.worker_error, self.server_error, self.work, self.anchor = [], [], [], []
        self.lrs = 0.0  # 0/1 Adam: sum of lr / bc1 since the last sync
        self.diverged = False  # 0/1 Adam: local steps since the last sync (replicas differ)
        with torch.no_grad():
            for params, grads in zip(self.reducer.params, self.reducer.flats):
                n, padded = grads.numel(), padded_numel(grads.numel(), world)
                # padded like the moments: ZeRO-1 (zero1.py) all-gathers the owned chunks of this buffer
                padded_flat = torch.zeros(padded, dtype=grads.dtype, device=grads.device)
                flat = padded_flat[:n]
                m = torch.zeros(padded, dtype=grads.dtype, device=grads.device)
                v = torch.zeros_like(m)
                offset, views = 0, []
                for p in params:  # the reducer's bucket order, so parameter and gradient offsets agree
                    view = flat[offset:offset + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view
                    step = torch.zeros((), device=p.device if on_device else "cpu")
                    self.optimizer.state[p] = {"step": step, "exp_avg": m[offset:offset + p.numel()].view_as(p),
                                               "exp_avg_sq": v[offset:offset + p.numel()].view_as(p)}
                    if p in decayed:
                        views.append(view)
                    offset += p.numel()
                self.param_flats.append(flat)
                self.param_padded.append(padded_flat)
                self.m.append(m)
                self.v.append(v)
                self.decayed.append(views)
                self.worker_error.append(torch.zeros_like(m))
                self.server_error.append(torch.zeros(padded // world, dtype=m.dtype, device=m.device))
                self.work.append(torch.zeros_like(m) if settings.name == "zero_one_adam" else None)

    # ---- the ZeroOptimizer interface -------------------------------------------------------------------
    def begin_micro_batch(self, last: bool) -> None:
        """Full-precision steps all-reduce in the last backward (stage 0); compressed ones keep local gradients."""
        self.reducer.begin(reduce=last and self.schedule.full_precision(self.steps))

    @torch.no_grad()
    def finish_gradients(self) -> None:
        if self.schedule.full_precision(self.steps):
            super().finish_gradients()

    @torch.no_grad()
    def step(self, lr: float) -> None:
        kind = self.schedule.kind(self.steps)
        if kind == "adamw":
            super().step(lr)  # torch state "step" += 1 inside
            self.steps += 1
            return
        if kind in ("local", "sync") and not self.anchor:  # entering 0/1 Adam's local phase
            self.anchor = [p.clone() for p in self.param_flats]
            for e in self.worker_error + self.server_error:  # they held gradient residues: another quantity
                e.zero_()
        beta1, beta2 = self.betas
        t = self.steps + 1
        bc1 = 1 - beta1 ** t
        bc2_sqrt = (1 - beta2 ** self.schedule.var_updates(self.steps)) ** 0.5
        group = self.topo.dp_group
        for i, (p, g, m, v) in enumerate(zip(self.param_flats, self.reducer.flats, self.m, self.v)):
            n = g.numel()
            if kind == "onebit":
                m[:n].lerp_(g, 1 - beta1)
                m[n:].zero_()
                compressed_all_reduce(m, self.worker_error[i], self.server_error[i], group, ledger=self.comm)
            elif kind == "onebit_grad":
                work = self.work[i]
                work[:n].copy_(g)
                work[n:].zero_()
                compressed_all_reduce(work, self.worker_error[i], self.server_error[i], group, ledger=self.comm)
                m[:n].lerp_(work[:n], 1 - beta1)
            else:  # "var": g was all-reduced; "local"/"sync": g is local
                m[:n].lerp_(g, 1 - beta1)
                if kind == "var":
                    v[:n].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v[:n].sqrt() / bc2_sqrt).add_(self.eps)
            for view in self.decayed[i]:
                view.mul_(1 - lr * self.weight_decay)
            if self.anchor:
                for view in self._anchor_views(i):
                    view.mul_(1 - lr * self.weight_decay)
            p.addcdiv_(m[:n], denom, value=-lr / bc1)
            if kind == "sync":
                self._synchronise(i, denom, self.lrs + lr / bc1)
        if kind in ("local", "sync"):
            self.lrs = 0.0 if kind == "sync" else self.lrs + lr / bc1
            self.diverged = kind == "local"
        self.steps += 1
        set_optimizer_steps(self.optimizer, self.steps)
        self.reducer.zero_()

    def _anchor_views(self, i: int):
        """The anchor's pieces of bucket i's decayed parameters (same offsets as the parameter views)."""
        base = self.param_flats[i]
        for view in self.decayed[i]:
            offset = view.storage_offset() - base.storage_offset()
            yield self.anchor[i][offset:offset + view.numel()]

    def _synchronise(self, i: int, denom: torch.Tensor, lrs: float) -> None:
        """0/1 Adam's sync of bucket i: average the accumulated updates (compressed), re-derive p and m."""
        p, anchor, work, n = self.param_flats[i], self.anchor[i], self.work[i], self.param_flats[i].numel()
        torch.sub(p, anchor, out=work[:n]).mul_(denom)
        work[n:].zero_()
        compressed_all_reduce(work, self.worker_error[i], self.server_error[i], self.topo.dp_group, ledger=self.comm)
        torch.addcdiv(anchor, work[:n], denom, out=p)
        torch.div(work[:n], -lrs, out=self.m[i][:n])
        anchor.copy_(p)

    # ---- per-rank state (checkpoints) ---------------------------------------------------------------------
    def rank_state(self) -> dict:
        """What differs between dp ranks and the parameter/moment views do not hold: the error buffers, 0/1
        Adam's anchor and, between its syncs, this rank's own parameters and momentum. Saved in its own file."""
        state = {"steps": self.steps, "worker_error": self.worker_error, "server_error": self.server_error,
                 "lrs": self.lrs, "diverged": self.diverged}
        if self.anchor:
            state["anchor"] = self.anchor
        if self.diverged:
            state["params"], state["momentum"] = self.param_flats, self.m
        return state

    @torch.no_grad()
    def load_rank_state(self, state: dict | None) -> None:
        """After a load: the step count from the optimizer; this rank's own state when the checkpoint has it
        (same layout), else error buffers from zero (an approximation the message of the caller names)."""
        self.steps = optimizer_steps(self.optimizer)
        for e in self.worker_error + self.server_error:
            e.zero_()
        self.anchor, self.lrs, self.diverged = [], 0.0, False
        if state is None:
            if self.schedule.kind(max(self.steps - 1, 0)) in ("local", "sync"):
                self.anchor = [p.clone() for p in self.param_flats]  # the loaded (rank 0's) parameters
            return
        if state["steps"] != self.steps:
            raise ValueError(f"{self.settings.name}: per-rank state of step {state['steps']}, optimizer at "
                             f"step {self.steps}")
        for mine, saved in zip(self.worker_error + self.server_error, state["worker_error"] + state["server_error"]):
            mine.copy_(saved)
        self.lrs, self.diverged = float(state["lrs"]), bool(state["diverged"])
        if "anchor" in state:
            self.anchor = [a.to(p.device, copy=True) for a, p in zip(state["anchor"], self.param_flats)]
        if self.diverged:
            for mine, saved in zip(self.param_flats + self.m, state["params"] + state["momentum"]):
                mine.copy_(saved)

    def memory_bytes(self) -> dict[str, int]:
        out = super().memory_bytes()
        extra = self.worker_error + self.server_error + [w for w in self.work if w is not None] + self.anchor
        padding = sum(m.numel() - g.numel() for m, g in zip(self.m, self.reducer.flats)) * 2
        out["optimizer"] += sum(t.numel() * t.element_size() for t in extra) + padding * self.m[0].element_size()
        return out
