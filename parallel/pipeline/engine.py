"""Runs a schedule's actions on this pipeline rank: compute, with the p2p plan's batches between actions.

Forward of (micro-batch i, chunk c) on virtual stage s = c * pp + rank: take the activation from stage s - 1
(the first stage reads token ids instead), run the chunk, hand the output to stage s + 1 - or, on the last
stage, compute the loss. Backward of (i, c): take d loss / d output from stage s + 1 (the last stage starts
from its loss), backpropagate through the chunk, hand d loss / d input to stage s - 1. Which transfers go out
together, and when, is p2p.py's plan (paired send/receive batches, deadlock-free under NCCL's rules). Each
forward's saved activations are dropped by its backward (split: by B; split_backward.py's store keeps what W
needs).

The engine also measures what the pipeline costs: compute time vs wall time per step (the bubble) and the most
micro-batches whose activations were alive at once on this rank.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megazoo.parallel import accelerator
from megazoo.parallel.pipeline.p2p import Step, is_local, post
from megazoo.parallel.pipeline.schedules import stage_of
from megazoo.parallel.pipeline.split_backward import PendingWeightGradient, backward_input, backward_weight
from megazoo.parallel.topology import Topology


@dataclass
class PipelineStats:
    """Compute (busy) and schedule (total) time on this rank, and the most micro-batches alive at once.

    On a GPU the times come from CUDA events (host clocks would time kernel launches, not kernels) and are
    resolved when read, after the step; on the CPU from the host clock."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    max_live_micro_batches: int = 0  # activations held at once (forwards without their backward yet)
    _busy: float = 0.0
    _total: float = 0.0
    _pending: list = field(default_factory=list)  # (start event, end event, busy?, kind) not yet read
    _kinds: dict = field(default_factory=dict)  # "F" / "B" / "W" -> compute seconds (B unsplit: the whole backward)

    def start(self):
        event = accelerator.timing_event(self.device)
        return time.perf_counter() if event is None else event  # no event on the CPU: the host clock

    def stop(self, started, busy: bool, kind: str | None = None) -> None:
        if self.device.type != "cuda":
            self._add(time.perf_counter() - started, busy, kind)
            return
        self._pending.append((started, self.start(), busy, kind))

    def _add(self, elapsed: float, busy: bool, kind: str | None) -> None:
        if busy:
            self._busy += elapsed
            if kind is not None:
                self._kinds[kind] = self._kinds.get(kind, 0.0) + elapsed
        else:
            self._total += elapsed

    def _resolve(self) -> None:
        for started, ended, busy, kind in self._pending:
            ended.synchronize()
            self._add(started.elapsed_time(ended) / 1000.0, busy, kind)
        self._pending.clear()

    @property
    def compute_s(self) -> dict[str, float]:  # compute seconds per action kind
        self._resolve()
        return dict(self._kinds)

    @property
    def busy_s(self) -> float:  # forward + backward compute on this rank
        self._resolve()
        return self._busy

    @property
    def total_s(self) -> float:  # wall time of the whole schedule
        self._resolve()
        return self._total

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0

    def reset(self) -> None:
        self._busy, self._total, self._pending, self.max_live_micro_batches = 0.0, 0.0, [], 0
        self._kinds = {}


class PipelineEngine:
    def __init__(self, chunks: list[torch.nn.Module], topo: Topology, *, hidden_size: int,
                 activation_dtype: torch.dtype, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 placement: str = "loop", recomputing: bool = False):
        self.chunks, self.topo, self.placement = chunks, topo, placement
        self.recomputing = recomputing  # activation checkpointing: a split backward keeps the graph (split_backward)
        self.v = len(chunks)
        self.stages = topo.pp * self.v
        self.hidden, self.dtype, self.loss_fn = hidden_size, activation_dtype, loss_fn
        self.stats = PipelineStats(device=topo.device)

    def _stage(self, chunk: int) -> int:
        return stage_of(chunk, self.topo.pp, self.topo.pp_rank, self.placement)

    def _transfer_buffers(self, transfers, outbox: dict, inbox: dict, micro_batches) -> list[torch.Tensor]:
        """The tensors a step's transfers send (taken from the outbox) and receive into (new, put in the inbox)."""
        buffers = []
        for t in transfers:
            if t.send:
                buffers.append(outbox.pop(t.identity))
            else:
                b, s = micro_batches[t.micro][0].shape
                if self.topo.sequence_parallel:  # a stage's hidden states are its tp rank's s / tp positions
                    s //= self.topo.tp
                inbox[t.identity] = torch.empty((b, s, self.hidden), dtype=self.dtype,
                                                device=self.topo.device)  # (b, s, d)
                buffers.append(inbox[t.identity])
        return buffers

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], steps: list[Step], *,
            loss_scale: float = 1.0, autocast=contextlib.nullcontext, forward_only: bool = False,
            before_backward: Callable[[bool], None] | None = None) -> list[torch.Tensor]:
        """Execute a p2p plan (p2p.plan of a schedule). Returns the per-micro-batch losses (detached, unscaled)
        on the rank holding the last stage, [] elsewhere. Backward uses loss * loss_scale / len(micro_batches),
        so gradients accumulate to the mean over micro-batches exactly as without pipelining."""
        start = self.stats.start()
        m = len(micro_batches)
        # (micro, chunk) -> (stage input, output or loss, logits on the last stage)
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = {}
        losses: dict[int, torch.Tensor] = {}
        outbox: dict[tuple, torch.Tensor] = {}  # identity -> tensor to send (kept alive until posted)
        inbox: dict[tuple, torch.Tensor] = {}  # identity -> received tensor
        split = {st.action[1:] for st in steps if st.action and st.action[0] == "W"}  # (micro, chunk) with a W
        pending: dict[tuple[int, int], PendingWeightGradient] = {}
        # The last action that accumulates parameter gradients: ZeRO-1 reduces during it.
        last_backward = max((k for k, st in enumerate(steps) if st.action and (
            st.action[0] == "W" or (st.action[0] == "B" and st.action[1:] not in split))), default=-1)
        for k, step in enumerate(steps):
            buffers = self._transfer_buffers(step.transfers, outbox, inbox, micro_batches)
            post(step.transfers, buffers, self.topo.pp_ranks)
            buffers.clear()  # post waited: a sent gradient or activation is not kept through this step's compute
            if step.action is None:
                continue
            kind, micro, chunk = step.action
            stage = self._stage(chunk)
            first, last = stage == 0, stage == self.stages - 1
            if kind == "F":
                x = micro_batches[micro][0] if first else \
                    inbox.pop((micro, stage - 1, False)).requires_grad_(not forward_only)
                tick = self.stats.start()
                with torch.set_grad_enabled(not forward_only), autocast():
                    # A third entry: packed rows' segment ids (models/packing.py), which every stage's attention needs.
                    extra = {"segment_ids": micro_batches[micro][2]} if len(micro_batches[micro]) > 2 else {}
                    out = logits = self.chunks[chunk](x, **extra)
                if last:
                    out = self.loss_fn(logits, micro_batches[micro][1])
                    losses[micro] = out.detach()
                self.stats.stop(tick, busy=True, kind="F")
                if not last:  # to the next stage: posted by the plan, or handed over here when it is on this rank
                    box = inbox if is_local(stage, stage + 1, self.topo.pp, self.placement) else outbox
                    box[(micro, stage, False)] = out.detach().contiguous()
                if not forward_only:
                    saved[(micro, chunk)] = (None if first else x, out, logits if last else None)
                    self.stats.max_live_micro_batches = max(self.stats.max_live_micro_batches, len(saved))
            elif kind == "W":
                if before_backward is not None:
                    before_backward(k == last_backward)
                tick = self.stats.start()
                backward_weight(pending.pop((micro, chunk)), list(self.chunks[chunk].parameters()))
                self.stats.stop(tick, busy=True, kind="W")
                saved.pop((micro, chunk))  # this micro-batch's activations are free now
            else:
                x, out, logits = saved[(micro, chunk)] if (micro, chunk) in split else saved.pop((micro, chunk))
                root = out * (loss_scale / m) if last else out
                grad = None if last else inbox.pop((micro, stage + 1, True))
                if (micro, chunk) in split:  # B: the input gradient only; W runs later
                    tick = self.stats.start()
                    dx, pending[(micro, chunk)] = backward_input(root, grad, x, logits, self.recomputing)
                    self.stats.stop(tick, busy=True, kind="B")
                    saved[(micro, chunk)] = (None, None, None)  # still live (counted): the store holds what W needs
                else:
                    if before_backward is not None:
                        before_backward(k == last_backward)
                    # The unsplit backward starts from the loss: the logits (b, s, V / tp) need not stay alive
                    # through the blocks' backward (the loss's graph keeps what its own backward reads).
                    logits = None
                    tick = self.stats.start()
                    torch.autograd.backward(root, grad)
                    self.stats.stop(tick, busy=True, kind="B")
                    dx = None if first else x.grad
                if not first:
                    box = inbox if is_local(stage, stage - 1, self.topo.pp, self.placement) else outbox
                    box[(micro, stage, True)] = dx.contiguous()
                del x, out, logits, root, grad, dx  # unsplit: this micro-batch's activations are free now
        assert not outbox and not inbox and not pending, "the p2p plan left transfers or weight gradients undone"
        self.stats.stop(start, busy=False)
        return [losses[i] for i in range(m)] if losses else []
