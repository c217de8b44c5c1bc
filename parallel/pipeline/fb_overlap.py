"""DualPipe-V's forward/backward overlap under expert parallelism (DeepSeek-V3 report, 2024, section 3.2.1).

In DualPipe-V's steady state a rank runs the forward of one micro-batch next to the backward of another. An MoE
layer's forward is attention (compute), dispatch (all-to-all), experts (compute), combine (all-to-all); its
backward the same four in reverse. Run one after the other, every all-to-all leaves the rank idle; run as a
pair, each all-to-all of one micro-batch is launched asynchronously and the other micro-batch computes while it
travels:

    F: attn | dispatch >>>>>>>>>>>>>>> | experts | combine >>>>>>>>>>>>>> | attn ...
    B:         combine-bwd | <<<<<<<<<<<<<< experts-bwd | dispatch-bwd <<<<<<<<<< | ...

A chunk that can be overlapped is a `SubStaged` module: besides its ordinary forward it lists its sub-stages as
`Compute` (a function of a tuple of tensors) and `Exchange` (an all-to-all of one tensor of that tuple, with
splits the previous compute chose). `forward_steps` and `backward_steps` are generators that run them and yield
right after launching an all-to-all (dist.all_to_all_single(async_op=True)); they wait on it only when they
resume, i.e. when its result is needed. `run_pair` alternates two such generators, so between one micro-batch's
launch and its wait the other micro-batch's compute runs. Each compute sub-stage is its own autograd graph (its
inputs detached leaves), so the backward can be driven sub-stage by sub-stage with the gradients' all-to-alls
asynchronous too; parameter gradients accumulate in .grad as in one backward.

A `Handshake` is a collective without gradient that a later exchange needs - the per-expert counts, whose
all-to-all tells each rank how many rows it will receive: launched after the route compute, waited just before
the dispatch, so it too travels under the other micro-batch's compute.

Under autocast (bf16 / fp16 runs) each compute runs inside the recipe's autocast context, as the ordinary engine
runs the whole chunk's forward; the backward runs outside it, as torch's autograd does for the ordinary engine
(each op's backward in the dtype its forward recorded).

Every ep rank of a pipeline stage runs the same plan, so all of them launch the same all-to-alls in the same
order (gloo and NCCL match collectives by order). `Events` records launches, waits and computes, which is how
the tests prove the overlap (an all-to-all in flight while the other micro-batch computes), not a clock; it also
sums the host seconds spent blocked in waits (`wait_s`), the exposed all-to-all time benchmarks/pipeline.py
prints (on a GPU an NCCL wait only orders streams, so there the host time is not the exposed time).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Protocol

import torch
import torch.distributed as dist

from megazoo.parallel.pipeline.split_backward import backward_input, backward_weight

Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Compute:
    """A compute sub-stage: fn(ctx, inputs) -> outputs. `ctx` is the micro-batch's own dict (routing orders,
    split sizes: what the exchanges and the backward read)."""

    name: str
    fn: Callable[[dict, Tensors], Tensors]


@dataclass(frozen=True)
class Exchange:
    """An all-to-all of element `index` of the running tuple over `group`; splits(ctx) -> (out_splits,
    in_splits) as the previous compute left them. Backward sends the gradient the other way (splits swapped)."""

    name: str
    index: int
    splits: Callable[[dict], tuple[list[int], list[int]]]
    group: dist.ProcessGroup | None


@dataclass(frozen=True)
class Handshake:
    """A forward-only collective that a later Exchange's splits need: start(ctx) launches it asynchronously and
    returns finish(), which waits on it and leaves what it brought in ctx. Nothing to do in the backward."""

    name: str
    start: Callable[[dict], Callable[[], None]]


Stage = Compute | Exchange | Handshake


class SubStaged(Protocol):
    def sub_stages(self) -> list[Stage]: ...


@dataclass
class Events:
    """What ran, in order: ("compute", micro, name, "F" | "B" | "W"), ("launch" | "wait", micro, name, "F" | "B");
    and the host seconds spent blocked in the waits, per phase ("F", "B")."""

    log: list[tuple[str, int, str, str]] = field(default_factory=list)
    wait_s: dict[str, float] = field(default_factory=lambda: {"F": 0.0, "B": 0.0})

    def add(self, kind: str, micro: int, name: str, phase: str) -> None:
        self.log.append((kind, micro, name, phase))

    def waited(self, phase: str, started: float) -> None:
        self.wait_s[phase] += time.perf_counter() - started


class _InFlight:
    def __init__(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
        if group is None:  # ep = 1: nothing travels
            self.out, self.work = x, None
            return
        self.out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.work = dist.all_to_all_single(self.out, x.contiguous(), output_split_sizes=out_splits,
                                           input_split_sizes=in_splits, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.out


@dataclass
class Record:
    """One micro-batch's forward through a chunk: per sub-stage (op, leaf inputs, outputs) for compute, (op,
    None, None) for an exchange; and its ctx. The backward walks it in reverse and frees it."""

    micro: int
    ctx: dict
    entries: list = field(default_factory=list)
    pending: list = field(default_factory=list)  # a split B's (compute name, PendingWeightGradient) for its W


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point())


def forward_steps(stages: list[Stage], x: torch.Tensor, micro: int, events: Events, grad: bool = True,
                  autocast: Callable = contextlib.nullcontext) -> Generator[None, None, tuple[torch.Tensor, Record]]:
    """Run the sub-stages on x, each compute under `autocast()`; yields after each launched all-to-all. Returns
    (output, record)."""
    record = Record(micro, {})
    state: Tensors = (x,)
    for op in stages:
        if isinstance(op, Compute):
            inputs = tuple(_leaf(t) for t in state) if grad else state
            with torch.set_grad_enabled(grad), autocast():
                outputs = op.fn(record.ctx, inputs)
            events.add("compute", micro, op.name, "F")
            record.entries.append((op, inputs, outputs))
            state = tuple(o.detach() for o in outputs)
        elif isinstance(op, Handshake):
            finish = op.start(record.ctx)
            events.add("launch", micro, op.name, "F")
            yield
            started = time.perf_counter()
            finish()
            events.waited("F", started)
            events.add("wait", micro, op.name, "F")
        else:
            out_splits, in_splits = op.splits(record.ctx)
            flight = _InFlight(state[op.index], out_splits, in_splits, op.group)
            events.add("launch", micro, op.name, "F")
            yield
            started = time.perf_counter()
            arrived = flight.wait()
            events.waited("F", started)
            events.add("wait", micro, op.name, "F")
            record.entries.append((op, None, None))
            state = state[:op.index] + (arrived,) + state[op.index + 1:]
    assert len(state) == 1, f"a chunk's last sub-stage must return one tensor, not {len(state)}"
    return state[0], record


def backward_steps(record: Record, grad_out: torch.Tensor, events: Events, split: bool = False
                   ) -> Generator[None, None, torch.Tensor | None]:
    """Backpropagate grad_out through the recorded sub-stages; yields after each launched all-to-all of a
    gradient. Returns d loss / d chunk input (None when the input needs none). Frees the record. `split`: the
    zero-bubble B - each compute gives its inputs' gradients only (split_backward.backward_input) and leaves its
    weight gradients in `record.pending` for `weight_steps` (W)."""
    grads: tuple[torch.Tensor | None, ...] = (grad_out,)
    while record.entries:
        op, inputs, outputs = record.entries.pop()
        if isinstance(op, Compute):
            pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
            if split:
                grads = _backward_input(record, op.name, inputs, pairs)
            else:
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                grads = tuple(t.grad if t.requires_grad else None for t in inputs)
            events.add("compute", record.micro, op.name, "B")
        else:
            out_splits, in_splits = op.splits(record.ctx)
            flight = _InFlight(grads[op.index], in_splits, out_splits, op.group)
            events.add("launch", record.micro, op.name, "B")
            yield
            started = time.perf_counter()
            sent_back = flight.wait()
            events.waited("B", started)
            events.add("wait", record.micro, op.name, "B")
            grads = grads[:op.index] + (sent_back,) + grads[op.index + 1:]
        del op, inputs, outputs
    return grads[0]


def _backward_input(record: Record, name: str, inputs: Tensors, pairs: list) -> tuple:
    """A compute's B: its inputs' gradients, the weight gradients stashed (record.pending). Its outputs and their
    gradients become one root, sum(o * g), whose gradient at each o is g exactly (1 * g)."""
    if not pairs:
        return (None,) * len(inputs)
    root = sum((o * g).sum() for o, g in pairs)
    dx, pending = backward_input(root, None, [t for t in inputs if t.requires_grad])
    record.pending.append((name, pending))
    got = iter(dx)
    return tuple(next(got) if t.requires_grad else None for t in inputs)


def weight_steps(record: Record, parameters: list[torch.nn.Parameter], events: Events) -> None:
    """W of a split backward: every compute's stashed weight gradients into .grad (split_backward.backward_weight;
    each parameter sits in one compute, so it is accumulated once, as in one backward)."""
    while record.pending:
        name, pending = record.pending.pop(0)
        backward_weight(pending, parameters)
        events.add("compute", record.micro, name, "W")


def run(gen: Generator):
    """Drive one generator to the end (no partner: each all-to-all is waited right after its launch)."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def run_pair(first: Generator, second: Generator) -> tuple:
    """Alternate two generators: each runs until it has launched an all-to-all, then the other runs (its compute
    under that all-to-all) and, when it resumes, waits. The order is fixed, so every ep rank launches the same
    collectives in the same order. Returns both results."""
    gens, results, alive = [first, second], [None, None], [True, True]
    while any(alive):
        for k in (0, 1):
            if alive[k]:
                try:
                    next(gens[k])
                except StopIteration as stop:
                    results[k], alive[k] = stop.value, False
    return tuple(results)


def overlapped(events: Events) -> list[tuple[int, str, str, int, str]]:
    """The overlaps the log shows: (micro, exchange, phase, other micro, its compute) for every compute of
    another micro-batch between an all-to-all's launch and its wait."""
    found, open_ = [], {}
    for kind, micro, name, phase in events.log:
        if kind == "launch":
            open_[(micro, name, phase)] = True
        elif kind == "wait":
            open_.pop((micro, name, phase))
        else:
            found += [(m, n, p, micro, name) for (m, n, p) in open_ if m != micro]
    return found
