"""The pipeline engine with DualPipe-V's forward/backward overlap (fb_overlap.py) for sub-staged chunks.

It executes the same p2p plan as PipelineEngine. Where the plan has a forward and a backward of two different
micro-batches back to back with no transfer between them (DualPipe-V's steady state: both inputs already in the
inbox, both outputs going to the outbox), it runs them as one overlapped pair: each one's all-to-alls travel while
the other computes. Every other action runs alone, its all-to-alls waited right away.

A split backward (a B with a later W: DualPipe-V's cool-down) is the zero-bubble one, sub-stage by sub-stage: B
gives each compute's input gradients (split_backward.backward_input on that compute's graph) and W accumulates
the weight gradients stashed for it (fb_overlap.weight_steps). Packed rows (segment ids) are not supported
(refused). Autocast is entered around each compute sub-stage (fb_overlap.forward_steps). The busy time
is per action, or per overlapped pair (kind "FB"), all-to-all waits included as in PipelineEngine, where a
synchronous all-to-all sits inside the chunk's forward or backward; `events.wait_s` is the part of it spent
blocked on all-to-alls. `events` holds the last run() only.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from megazoo.parallel.pipeline.engine import PipelineEngine
from megazoo.parallel.pipeline.fb_overlap import Events, backward_steps, forward_steps, run, run_pair, weight_steps
from megazoo.parallel.pipeline.p2p import Step, is_local, post
from megazoo.parallel.pipeline.schedules import stage_of


def _output(action, pp: int, rank: int, placement: str) -> tuple[int, int, bool]:
    kind, micro, chunk = action
    return (micro, stage_of(chunk, pp, rank, placement), kind == "B")


def _input(action, pp: int, rank: int, placement: str) -> tuple[int, int, bool]:
    kind, micro, chunk = action
    stage = stage_of(chunk, pp, rank, placement)
    return (micro, stage - 1, False) if kind == "F" else (micro, stage + 1, True)


def overlap_plan(steps: list[Step], pp: int, rank: int, placement: str = "v") -> list[Step]:
    """The plan with each transfer batch T that sits between an F and a B of two micro-batches (A, T, B) moved
    out of the way, so that the two run back to back as one overlapped pair: before A (T, A, B) when T does not
    send A's output, else after B (A, B, T) when T does not receive B's input. Either way no action waits on
    anything new (A fed nothing in T; B needed nothing from it) and T's peer side is unchanged; p2p.check_plan
    is run on the result in the tests, as on every plan."""
    out = list(steps)
    k = 0
    while k + 2 < len(out):
        a, t, b = out[k], out[k + 1], out[k + 2]
        if _pairable(a, t):  # already back to back: leave them (pairs() takes them)
            k += 2
            continue
        if t.action is not None or b.transfers or not _pairable(a, Step((), b.action)):
            k += 1
            continue
        if not any(x.send and x.identity == _output(a.action, pp, rank, placement) for x in t.transfers):
            out[k], out[k + 1] = t, a
        elif not any(not x.send and x.identity == _input(b.action, pp, rank, placement) for x in t.transfers):
            out[k + 1], out[k + 2] = b, t
        k += 3
    return out


def _pairable(first: Step, second: Step) -> bool:
    a, b = first.action, second.action
    return (a is not None and b is not None and not second.transfers and {a[0], b[0]} == {"F", "B"}
            and a[1] != b[1])


def pairs(steps: list[Step]) -> set[int]:
    """Indices k whose action runs overlapped with action k + 1: an F and a B of different micro-batches, back to
    back, with no transfer posted between them."""
    found: set[int] = set()
    k = 0
    while k + 1 < len(steps):
        if _pairable(steps[k], steps[k + 1]):
            found.add(k)
            k += 2
        else:
            k += 1
    return found


class OverlapPipelineEngine(PipelineEngine):
    """PipelineEngine for chunks with `sub_stages()` (fb_overlap.SubStaged); `events` records what ran."""

    def __init__(self, *args, sub_stages: Callable[[torch.nn.Module], list] | None = None, **kwargs):
        """`sub_stages(chunk)`: a chunk's sub-stages, where the chunk does not list them itself (the decoder's,
        recipes/training/model_setup.overlap_sub_stages: parallel does not import models)."""
        super().__init__(*args, **kwargs)
        self.sub_stages = sub_stages if sub_stages is not None else (lambda chunk: chunk.sub_stages())
        missing = [] if sub_stages is not None else [i for i, c in enumerate(self.chunks)
                                                     if not hasattr(c, "sub_stages")]
        if missing:
            raise ValueError(f"the forward/backward overlap needs every model chunk split into sub-stages "
                             f"(sub_stages()); chunks {missing} are not")
        self.events = Events()
        # False: every action alone, each all-to-all waited right after its launch - the same sub-stages without
        # the overlap (benchmarks/pipeline.py --overlap's control row: what the sub-staging itself costs)
        self.pair = True

    def run(self, micro_batches: list[tuple[torch.Tensor, ...]], steps: list[Step], *, loss_scale: float = 1.0,
            autocast=contextlib.nullcontext, forward_only: bool = False,
            before_backward: Callable[[bool], None] | None = None) -> list[torch.Tensor]:
        if any(len(mb) > 2 for mb in micro_batches):
            raise ValueError("the forward/backward overlap runs without packed rows (segment ids)")
        self.events = Events()  # this run's: a log kept across steps would grow without end
        start = self.stats.start()
        m = len(micro_batches)
        saved: dict[tuple[int, int], tuple] = {}
        losses: dict[int, torch.Tensor] = {}
        outbox: dict[tuple, torch.Tensor] = {}
        inbox: dict[tuple, torch.Tensor] = {}

        def forward(micro: int, chunk: int):
            stage = self._stage(chunk)
            first, last = stage == 0, stage == self.stages - 1
            x = micro_batches[micro][0] if first else inbox.pop((micro, stage - 1, False))
            out, record = yield from forward_steps(self.sub_stages(self.chunks[chunk]), x, micro, self.events,
                                                   grad=not forward_only, autocast=autocast)
            loss = None
            if last:
                out.requires_grad_(not forward_only)
                with torch.set_grad_enabled(not forward_only):
                    loss = self.loss_fn(out, micro_batches[micro][1])
                losses[micro] = loss.detach()
            else:
                box = inbox if is_local(stage, stage + 1, self.topo.pp, self.placement) else outbox
                box[(micro, stage, False)] = out.detach().contiguous()
            if not forward_only:
                saved[(micro, chunk)] = (record, out, loss)
                live = len(saved) + len(waiting)  # a split B's micro-batch is live until its W
                self.stats.max_live_micro_batches = max(self.stats.max_live_micro_batches, live)

        def backward(micro: int, chunk: int):
            stage = self._stage(chunk)
            first, last = stage == 0, stage == self.stages - 1
            record, out, loss = saved.pop((micro, chunk))
            if last:
                torch.autograd.backward(loss * (loss_scale / m))
                grad = out.grad
            else:
                grad = inbox.pop((micro, stage + 1, True))
            dx = yield from backward_steps(record, grad, self.events, split=(micro, chunk) in split)
            if (micro, chunk) in split:  # W runs later: the record holds the stashed weight gradients till then
                waiting[(micro, chunk)] = record
            if not first:
                box = inbox if is_local(stage, stage - 1, self.topo.pp, self.placement) else outbox
                box[(micro, stage, True)] = dx.contiguous()

        def job(action):
            kind, micro, chunk = action
            return forward(micro, chunk) if kind == "F" else backward(micro, chunk)

        steps = overlap_plan(steps, self.topo.pp, self.topo.pp_rank, self.placement)
        split = {st.action[1:] for st in steps if st.action and st.action[0] == "W"}  # (micro, chunk) with a W
        waiting: dict[tuple[int, int], object] = {}  # split B done, its W not yet: the record with its stash

        def accumulates(action) -> bool:  # into parameter gradients: a W, or a B without a W
            return action[0] == "W" or (action[0] == "B" and action[1:] not in split)

        # The last action that accumulates parameter gradients: ZeRO-1 reduces in it.
        last_backward = max((k for k, st in enumerate(steps) if st.action and accumulates(st.action)), default=-1)
        paired = pairs(steps) if self.pair else set()
        k = 0
        while k < len(steps):
            step = steps[k]
            buffers = self._transfer_buffers(step.transfers, outbox, inbox, micro_batches)
            post(step.transfers, buffers, self.topo.pp_ranks)
            buffers.clear()
            if step.action is None:
                k += 1
                continue
            both = [step.action] + ([steps[k + 1].action] if k in paired else [])
            if before_backward is not None and any(accumulates(a) for a in both):
                before_backward(last_backward in (k, k + len(both) - 1))
            tick = self.stats.start()
            if step.action[0] == "W":
                _, micro, chunk = step.action
                weight_steps(waiting.pop((micro, chunk)), list(self.chunks[chunk].parameters()), self.events)
            elif len(both) == 2:
                run_pair(job(both[0]), job(both[1]))
            else:
                run(job(both[0]))
            self.stats.stop(tick, busy=True, kind="FB" if len(both) == 2 else both[0][0])
            k += len(both)
        assert not outbox and not inbox and not saved and not waiting, \
            "the p2p plan left transfers, backwards or weight gradients undone"
        self.stats.stop(start, busy=False)
        return [losses[i] for i in range(m)] if losses else []
