"""Runs a schedule's actions on this pipeline rank: compute, with the p2p plan's batches between actions.

Forward of (micro-batch i, chunk c) on virtual stage s = c * pp + rank: take the activation from stage s - 1
(the first stage reads token ids instead), run the chunk, hand the output to stage s + 1 - or, on the last
stage, compute the loss. Backward of (i, c): take d loss / d output from stage s + 1 (the last stage starts
from its loss), backpropagate through the chunk, hand d loss / d input to stage s - 1. Which transfers go out
together, and when, is p2p.py's plan (paired send/receive batches, deadlock-free under NCCL's rules). Each
forward's saved activations are dropped by its backward.

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
from megazoo.parallel.pipeline.p2p import Step, post
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
    _pending: list = field(default_factory=list)  # (start event, end event, busy?) not yet read

    def start(self):
        event = accelerator.timing_event(self.device)
        return time.perf_counter() if event is None else event  # no event on the CPU: the host clock

    def stop(self, started, busy: bool) -> None:
        if self.device.type != "cuda":
            elapsed = time.perf_counter() - started
            if busy:
                self._busy += elapsed
            else:
                self._total += elapsed
            return
        self._pending.append((started, self.start(), busy))

    def _resolve(self) -> None:
        for started, ended, busy in self._pending:
            ended.synchronize()
            elapsed = started.elapsed_time(ended) / 1000.0
            if busy:
                self._busy += elapsed
            else:
                self._total += elapsed
        self._pending.clear()

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


class PipelineEngine:
    def __init__(self, chunks: list[torch.nn.Module], topo: Topology, *, hidden_size: int,
                 activation_dtype: torch.dtype, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.chunks, self.topo = chunks, topo
        self.v = len(chunks)
        self.stages = topo.pp * self.v
        self.hidden, self.dtype, self.loss_fn = hidden_size, activation_dtype, loss_fn
        self.stats = PipelineStats(device=topo.device)

    def _stage(self, chunk: int) -> int:
        return chunk * self.topo.pp + self.topo.pp_rank

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], steps: list[Step], *,
            loss_scale: float = 1.0, autocast=contextlib.nullcontext, forward_only: bool = False,
            before_backward: Callable[[bool], None] | None = None) -> list[torch.Tensor]:
        """Execute a p2p plan (p2p.plan of a schedule). Returns the per-micro-batch losses (detached, unscaled)
        on the rank holding the last stage, [] elsewhere. Backward uses loss * loss_scale / len(micro_batches),
        so gradients accumulate to the mean over micro-batches exactly as without pipelining."""
        start = self.stats.start()
        m = len(micro_batches)
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses: dict[int, torch.Tensor] = {}
        outbox: dict[tuple, torch.Tensor] = {}  # identity -> tensor to send (kept alive until posted)
        inbox: dict[tuple, torch.Tensor] = {}  # identity -> received tensor
        last_backward = max((k for k, st in enumerate(steps) if st.action and st.action[0] == "B"), default=-1)
        for k, step in enumerate(steps):
            buffers = []
            for t in step.transfers:
                if t.send:
                    buffers.append(outbox.pop(t.identity))
                else:
                    ids = micro_batches[t.micro][0]
                    inbox[t.identity] = torch.empty((*ids.shape, self.hidden), dtype=self.dtype,
                                                    device=self.topo.device)  # (b, s, d)
                    buffers.append(inbox[t.identity])
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
                    out = self.chunks[chunk](x)
                if last:
                    out = self.loss_fn(out, micro_batches[micro][1])
                    losses[micro] = out.detach()
                self.stats.stop(tick, busy=True)
                if not last:
                    outbox[(micro, stage, False)] = out.detach().contiguous()
                if not forward_only:
                    saved[(micro, chunk)] = (None if first else x, out)
                    self.stats.max_live_micro_batches = max(self.stats.max_live_micro_batches, len(saved))
            else:
                x, out = saved.pop((micro, chunk))
                if before_backward is not None:
                    before_backward(k == last_backward)
                tick = self.stats.start()
                if last:
                    (out * (loss_scale / m)).backward()
                else:
                    torch.autograd.backward(out, inbox.pop((micro, stage + 1, True)))
                self.stats.stop(tick, busy=True)
                if not first:
                    outbox[(micro, stage, True)] = x.grad.contiguous()
                del x, out  # this micro-batch's activations are free now
        assert not outbox and not inbox, "the p2p plan left transfers unposted"
        self.stats.stop(start, busy=False)
        return [losses[i] for i in range(m)] if losses else []
