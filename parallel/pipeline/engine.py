"""Runs a schedule's actions on this pipeline rank: compute plus point-to-point transfers.

Forward of (micro-batch i, chunk c) on virtual stage s = c * pp + rank:
  receive the activation from stage s - 1 (blocking irecv; the first stage reads token ids instead), run the
  chunk, then send the output to stage s + 1 (non-blocking isend) - or, on the last stage, compute the loss.
Backward of (i, c):
  receive d loss / d output from stage s + 1 (the last stage starts from its loss), backpropagate through the
  chunk, send d loss / d input to stage s - 1.
Sends never block and receives happen in schedule order, which is what makes GPipe, 1F1B and interleaved 1F1B
deadlock-free here. Every message carries a tag naming (micro-batch, stage, direction), so transfers between
the same two ranks can never be confused. Each forward's saved activations are dropped by its backward.

The engine also measures what the pipeline costs: compute time vs wall time per step (the bubble) and the most
micro-batches whose activations were alive at once on this rank.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megazoo.parallel.pipeline.schedules import Action
from megazoo.parallel.topology import Topology


@dataclass
class PipelineStats:
    busy_s: float = 0.0  # forward + backward compute on this rank
    total_s: float = 0.0  # wall time of the whole schedule
    max_live_micro_batches: int = 0  # activations held at once (forwards without their backward yet)

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0


class PipelineEngine:
    def __init__(self, chunks: list[torch.nn.Module], topo: Topology, *, hidden_size: int,
                 activation_dtype: torch.dtype, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.chunks, self.topo = chunks, topo
        self.v = len(chunks)
        self.stages = topo.pp * self.v
        self.hidden, self.dtype, self.loss_fn = hidden_size, activation_dtype, loss_fn
        self.prev_rank = topo.pp_ranks[(topo.pp_rank - 1) % topo.pp]
        self.next_rank = topo.pp_ranks[(topo.pp_rank + 1) % topo.pp]
        self.stats = PipelineStats()

    def _stage(self, chunk: int) -> int:
        return chunk * self.topo.pp + self.topo.pp_rank

    def _tag(self, micro: int, stage: int, backward: bool) -> int:
        return (micro * self.stages + stage) * 2 + int(backward)

    def _recv(self, src: int, tag: int, ids: torch.Tensor) -> torch.Tensor:
        buf = torch.empty((*ids.shape, self.hidden), dtype=self.dtype, device=self.topo.device)  # (b, s, d)
        dist.irecv(buf, src, tag=tag).wait()
        return buf

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], actions: list[Action], *,
            loss_scale: float = 1.0, autocast=contextlib.nullcontext, forward_only: bool = False,
            before_backward: Callable[[bool], None] | None = None) -> list[torch.Tensor]:
        """Execute `actions`. Returns the per-micro-batch losses (detached, unscaled) on the rank holding the last
        stage, [] elsewhere. Backward uses loss * loss_scale / len(micro_batches), so gradients accumulate to the
        mean over micro-batches exactly as without pipelining."""
        start = time.perf_counter()
        m, pp = len(micro_batches), self.topo.pp
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses: dict[int, torch.Tensor] = {}
        sends: list = []
        last_backward = max((k for k, a in enumerate(actions) if a[0] == "B"), default=-1)
        for k, (kind, micro, chunk) in enumerate(actions):
            stage = self._stage(chunk)
            first, last = stage == 0, stage == self.stages - 1
            if kind == "F":
                x = micro_batches[micro][0] if first else \
                    self._recv(self.prev_rank, self._tag(micro, stage - 1, False), micro_batches[micro][0]) \
                    .requires_grad_(not forward_only)
                tick = time.perf_counter()
                with torch.set_grad_enabled(not forward_only), autocast():
                    out = self.chunks[chunk](x)
                if last:
                    out = self.loss_fn(out, micro_batches[micro][1])
                    losses[micro] = out.detach()
                self.stats.busy_s += time.perf_counter() - tick
                if not last:
                    sends.append((dist.isend(out.detach().contiguous(), self.next_rank,
                                             tag=self._tag(micro, stage, False)), out))
                if not forward_only:
                    saved[(micro, chunk)] = (None if first else x, out)
                    self.stats.max_live_micro_batches = max(self.stats.max_live_micro_batches, len(saved))
            else:
                x, out = saved.pop((micro, chunk))
                if before_backward is not None:
                    before_backward(k == last_backward)
                grad = None if last else self._recv(self.next_rank, self._tag(micro, stage, True),
                                                    micro_batches[micro][0])
                tick = time.perf_counter()
                if last:
                    (out * (loss_scale / m)).backward()
                else:
                    torch.autograd.backward(out, grad)
                self.stats.busy_s += time.perf_counter() - tick
                if not first:
                    sends.append((dist.isend(x.grad.contiguous(), self.prev_rank,
                                             tag=self._tag(micro, stage - 1, True)), x.grad))
                del x, out  # this micro-batch's activations are free now
        for work, _ in sends:
            work.wait()
        self.stats.total_s += time.perf_counter() - start
        return [losses[i] for i in range(m)] if losses else []
