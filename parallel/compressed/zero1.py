"""1-bit Adam and 0/1 Adam at ZeRO stage 1: the same arithmetic as stage 0 (optimizer.py), states partitioned.

Every dp rank keeps full parameters and full gradient buckets (as stage 0) but, per bucket padded to 8 x dp and
cut in dp equal chunks, only the chunk it owns of what is identical on every rank:

  variance v      its owned chunk, always (warm-up, 0/1 Adam's "var" steps: from the all-reduced gradient;
                  afterwards frozen).
  momentum m      warm-up, "var", "onebit_grad": its owned chunk (m is updated from an averaged gradient, so it
                  is identical on every rank). 1-bit Adam after the warm-up: m is the compressed average of the
                  ranks' local momenta, i.e. exactly the decoded all-gathered sign bytes, so it is kept as those
                  bytes (n / 8 + one scale per chunk) and decoded bit-exactly into a transient full buffer when
                  the next step needs it (every worker compresses its full local momentum: the math needs it whole
                  for the length of one bucket's step).
  worker error    full, on every rank: each rank's own compression residue (not shared, cannot be partitioned).
  server error    already 1 / dp per rank at stage 0.

One step, per bucket: the stage-0 update of the owned element range [lo, hi) only (decay, Adam's update with the
bias corrections), then one all-gather of the owned parameter chunks over dp (collective added by ZeRO-1, in the
parameters' dtype: 4 n bytes x (N-1)/N in fp32), on top of stage 0's collectives (all-reduce of the gradient on
full-precision steps, all-to-all + all-gather of sign bytes on compressed ones). 1-bit Adam's first compressed
step all-gathers the warm-up momentum chunks once (full precision).

0/1 Adam's local phase (from var_freeze_step): each rank steps its own full parameters with its own full
momentum and the frozen full variance without communicating, so the math leaves nothing identical to partition:
at the first local step m and v are all-gathered once and the stage-0 code runs from there (memory as stage 0).

Checkpoints: parameters are saved whole by dp rank 0; m and v as each rank's owned element ranges (the views a
partitioned stage writes), so any layout loads them. Per-rank state (error buffers, 0/1 Adam's anchor and
diverged replicas) is stage 0's rank_state.
"""

from __future__ import annotations

import torch

from megazoo.parallel.checkpoint.views import (StateView, optimizer_steps, set_optimizer_steps,
                                              whole_param_views)
from megazoo.parallel.collectives import all_gather_flat
from megazoo.parallel.compressed.comms import compressed_all_reduce, compressed_average_packed
from megazoo.parallel.compressed.optimizer import CompressedAdam
from megazoo.parallel.compressed.packing import decode


class CompressedAdamZero1(CompressedAdam):
    def __init__(self, named, topo, **kwargs):
        super().__init__(named, topo, **kwargs)
        world, rank = self.reducer.size, topo.grad_rank
        self.rank, self.world = rank, world
        self.full_mode = False  # 0/1 Adam's local phase: self.m / self.v are stage 0's full buffers again
        self.chunk, self.owned, self.decay_ranges = [], [], []
        self.m_chunk: list[torch.Tensor | None] = []
        self.m_packed: list[torch.Tensor | None] = [None] * len(self.m)
        self.v_chunk: list[torch.Tensor] = []
        self._state_m: list[torch.Tensor] = []  # what state_views handed out for m (loaded into by a load)
        for i, (flat, m) in enumerate(zip(self.param_flats, self.m)):
            c, n = m.numel() // world, flat.numel()
            lo, hi = min(rank * c, n), min((rank + 1) * c, n)
            self.chunk.append(c)
            self.owned.append((lo, hi))
            self.m_chunk.append(m[rank * c:(rank + 1) * c].clone())
            self.v_chunk.append(self.v[i][rank * c:(rank + 1) * c].clone())
            ranges = []
            for view in self.decayed[i]:
                a = view.storage_offset() - flat.storage_offset()
                a, b = max(a, lo), min(a + view.numel(), hi)
                if a < b:
                    ranges.append((a, b))
            self.decay_ranges.append(ranges)
        # the full moments (and the torch optimizer's views into them) go: only the step counters stay there
        for state in self.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state.pop(key, None)
        self.m, self.v = [], []
        self.work = [None] * len(self.work)  # 0/1 Adam's compressed steps use a transient buffer per bucket

    # ---- one step --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> None:
        kind = self.schedule.kind(self.steps)
        if self.full_mode or kind in ("local", "sync"):
            if not self.full_mode:
                self._to_full()
            super().step(lr)
            return
        beta1, beta2 = self.betas
        t = self.steps + 1
        bc1 = 1 - beta1 ** t
        bc2_sqrt = (1 - beta2 ** self.schedule.var_updates(self.steps)) ** 0.5  # = AdamW's during the warm-up
        group = self.topo.dp_group
        for i, (p, g) in enumerate(zip(self.param_flats, self.reducer.flats)):
            (lo, hi), c = self.owned[i], self.chunk[i]
            k = hi - lo
            start = self.rank * c  # the owned chunk's offset in the padded bucket
            if kind in ("adamw", "var"):  # g was all-reduced: the owned moments from its owned range
                m_own = self.m_chunk[i]
                m_own[:k].lerp_(g[lo:hi], 1 - beta1)
                self.v_chunk[i][:k].mul_(beta2).addcmul_(g[lo:hi], g[lo:hi], value=1 - beta2)
            elif kind == "onebit_grad":  # 0/1 Adam: the gradient compressed-averaged, then the owned momentum
                work = torch.zeros(c * self.world, dtype=g.dtype, device=g.device)
                work[:g.numel()].copy_(g)
                compressed_all_reduce(work, self.worker_error[i], self.server_error[i], group, ledger=self.comm)
                m_own = self.m_chunk[i]
                m_own[:k].lerp_(work[lo:hi], 1 - beta1)
            else:  # "onebit": every rank's full local momentum, compressed-averaged; kept as the gathered bytes
                work = self._full_momentum(i)
                n = g.numel()
                work[:n].lerp_(g, 1 - beta1)
                work[n:].zero_()
                wire = compressed_average_packed(work, self.worker_error[i], self.server_error[i], group,
                                                 ledger=self.comm)
                self.m_packed[i], self.m_chunk[i] = wire, None
                m_own = decode(wire[self.rank:self.rank + 1], g.dtype).view(-1)
            denom = (self.v_chunk[i][:k].sqrt() / bc2_sqrt).add_(self.eps)
            for a, b in self.decay_ranges[i]:
                p[a:b].mul_(1 - lr * self.weight_decay)
            p[lo:hi].addcdiv_(m_own[:k], denom, value=-lr / bc1)
            self._gather_params(i, start, c)
        self.steps += 1
        set_optimizer_steps(self.optimizer, self.steps)
        self.reducer.zero_()

    def _gather_params(self, i: int, start: int, c: int) -> None:
        """Collective: all-gather of every rank's owned parameter chunk of bucket i over dp (in place)."""
        full = self.param_padded[i]
        if self.topo.dp_group is not None:
            all_gather_flat(full, full[start:start + c].clone(), self.topo.dp_group, ledger=self.comm)

    def _all_gather_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        full = torch.empty(chunk.numel() * self.world, dtype=chunk.dtype, device=chunk.device)
        if self.topo.dp_group is None:
            full.copy_(chunk)
        else:
            all_gather_flat(full, chunk, self.topo.dp_group, ledger=self.comm)
        return full

    def _full_momentum(self, i: int) -> torch.Tensor:
        """A transient full (padded) momentum of bucket i: decoded from the kept sign bytes (the exact values
        stage 0 holds), or, at the first compressed step after the warm-up or a load, all-gathered."""
        if self.m_packed[i] is not None:
            return decode(self.m_packed[i], self.param_flats[i].dtype).view(-1)
        return self._all_gather_chunk(self.m_chunk[i])

    def _to_full(self) -> None:
        """0/1 Adam entering its local phase: one all-gather of m and v per bucket; stage 0's buffers from here."""
        self.m = [self._all_gather_chunk(m) for m in self.m_chunk]
        self.v = [self._all_gather_chunk(v) for v in self.v_chunk]
        self.work = [torch.zeros_like(m) for m in self.m]
        self.m_chunk, self.v_chunk = [None] * len(self.m), [None] * len(self.v)
        self.full_mode = True

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def _owned_m(self, i: int) -> torch.Tensor:
        start, c = self.rank * self.chunk[i], self.chunk[i]
        if self.full_mode:
            return self.m[i][start:start + c]
        if self.m_chunk[i] is not None:
            return self.m_chunk[i]
        return decode(self.m_packed[i][self.rank:self.rank + 1], self.param_flats[i].dtype).view(-1)

    def _owned_v(self, i: int) -> torch.Tensor:
        start, c = self.rank * self.chunk[i], self.chunk[i]
        return self.v[i][start:start + c] if self.full_mode else self.v_chunk[i]

    def state_views(self) -> list[StateView]:
        """Whole parameters (dp rank 0 writes them); m and v as this rank's owned element ranges."""
        name_of = {p: (name, spec) for name, p, spec in self.named}
        write = self.topo.grad_rank == 0
        views = [view for name, p, spec in self.named if p.requires_grad
                 for view in whole_param_views(name, spec, p, None, write)]
        self._state_m = [self._owned_m(i) for i in range(len(self.param_flats))]
        for i, params in enumerate(self.reducer.params):
            (lo, hi), flat = self.owned[i], self.param_flats[i]
            moments = {"exp_avg": self._state_m[i], "exp_avg_sq": self._owned_v(i)}
            for p in params:
                off = p.data.storage_offset() - flat.storage_offset()
                a, b = max(off, lo), min(off + p.numel(), hi)
                if a >= b:
                    continue
                name, spec = name_of[p]
                views += [StateView(name, spec, kind, a - off, b - off, t[a - lo:b - lo], True)
                          for kind, t in moments.items()]
        return views

    @torch.no_grad()
    def after_load(self) -> None:
        """The owned moment ranges were loaded into what state_views handed out: back to the partitioned form
        (the local phase's full buffers are rebuilt by load_rank_state or the next local step)."""
        self.m_chunk = [m.clone() for m in self._state_m]
        self.v_chunk = [self._owned_v(i).clone() for i in range(len(self.param_flats))]
        self.m_packed = [None] * len(self.m_chunk)
        self.m, self.v, self.full_mode = [], [], False
        self.work = [None] * len(self.m_chunk)

    @torch.no_grad()
    def load_rank_state(self, state: dict | None) -> None:
        steps = optimizer_steps(self.optimizer)
        if self.settings.name == "zero_one_adam" and steps >= self.settings.var_freeze_step:
            self._to_full()  # the local phase: full buffers before stage 0 restores the diverged replicas
        super().load_rank_state(state)

    def memory_bytes(self) -> dict[str, int]:
        def size(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        params = sum(p.numel() * p.element_size() for p in self.params)
        grads = size(self.reducer.flats)
        states = (size(self.m_chunk) + size(self.m_packed) + size(self.v_chunk) + size(self.m) + size(self.v)
                  + size(self.worker_error) + size(self.server_error) + size(self.work) + size(self.anchor))
        return {"params": params, "grads": grads, "optimizer": states}
