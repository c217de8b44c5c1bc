"""Sequence parallelism inside the tensor-parallel group (Korthikanti et al. 2022, Megatron's `sequence_parallel`).

Without it, every tp rank holds the whole (b, s, d) residual stream between the tensor-parallel regions: the norms,
the residual adds and the dropouts run tp times on identical copies, and their activations are stored tp times.
With it, those regions hold only this rank's s / tp positions (the sequence is dim 1 of every (b, s, d) tensor) and
the all-reduce that ends a row-parallel layer becomes a reduce-scatter along the sequence, the identity that enters
a column-parallel layer an all-gather along it. The bytes a rank sends are the same (an all-reduce is a
reduce-scatter followed by an all-gather); the activations of the norm and dropout regions shrink by tp.

| region boundary                     | forward                          | backward                         |
|-------------------------------------|----------------------------------|----------------------------------|
| enter / linears (column-parallel)   | all-gather along the sequence    | reduce-scatter along the sequence |
| leave (row-parallel output)         | reduce-scatter along the sequence | all-gather along the sequence    |
| shard (after the embedding)         | keep this rank's s / tp          | all-gather along the sequence    |
| replicated (norm weights, row bias) | identity                         | all-reduce of the gradient       |

The last row: a parameter replicated over tp but applied to this rank's positions only gets a partial gradient;
its all-reduce in backward makes every rank's gradient the full one, identical on all ranks, as without sequence
parallelism. `SequenceParallel(group, enabled=False)` is plain tensor parallelism (copy_to_tp_region /
reduce_from_tp_region), so the layers have one code path; `suspended()` turns it off for KV-cache decoding, whose
new tokens are too few to split.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megazoo.parallel.collectives import all_gather_stacked, reduce_scatter_flat
from megazoo.parallel.tensor.comms import copy_to_tp_region, reduce_from_tp_region
from megazoo.parallel.topology import group_rank, group_size

SEQUENCE_DIM = 1  # of (b, s, d)


def _split(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[SEQUENCE_DIM] % size:
        raise ValueError(f"sequence length {x.shape[SEQUENCE_DIM]} is not divisible by the tensor-parallel size "
                         f"{size}: parallel.sequence_parallel needs sequences (per cp rank) in multiples of tp")
    # A copy, never a view: at micro-batch 1 the (1, s/tp, d) piece of a (1, s, d) tensor is contiguous, and a
    # view (what .contiguous() returns then) would keep the whole (b, s, d) storage alive for as long as the shard
    # lives - on the first pipeline stage the embedding's full output, for every micro-batch in flight.
    return x.chunk(size, dim=SEQUENCE_DIM)[group_rank(group)].clone(memory_format=torch.contiguous_format)


def _gather(x: torch.Tensor, group, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(b, s/tp, d) on every rank -> (b, s, d) in `dtype` (default x's). The shard is cast before the gather (the
    same values: a cast is elementwise), so only the gathered bytes of the matmuls' dtype are ever allocated. The
    flat all-gather stacks the ranks' pieces along dim 0; at b = 1 that is already the (1, s, d) layout (returned
    as a view: no second full-size buffer), otherwise one copy lays them end to end along the sequence."""
    size = group_size(group)
    x = x if dtype is None else x.to(dtype)
    b, n = x.shape[0], x.shape[SEQUENCE_DIM]
    stacked = all_gather_stacked(x, group, size).transpose(0, 1)  # (b, size, s/size, ...)
    if stacked.is_contiguous():
        return stacked.reshape(b, size * n, *x.shape[2:])
    return stacked.reshape(b, size * n, *x.shape[2:]).contiguous()


def _reduce_scatter(x: torch.Tensor, group, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(b, s, d) partial sums on every rank -> this rank's (b, s/tp, d) of their sum, reduced in `dtype`
    (default x's). The flat reduce-scatter splits along dim 0: one copy brings the sequence pieces there, casting;
    at b = 1 in x's own dtype the pieces already lie along dim 0 and x is reduced as it is (no full-size copy)."""
    size = group_size(group)
    if x.shape[SEQUENCE_DIM] % size:
        raise ValueError(f"sequence length {x.shape[SEQUENCE_DIM]} is not divisible by the tensor-parallel size "
                         f"{size}: parallel.sequence_parallel needs sequences (per cp rank) in multiples of tp")
    b, n = x.shape[0], x.shape[SEQUENCE_DIM] // size
    moved = x.unflatten(SEQUENCE_DIM, (size, n)).transpose(0, 1)  # (size, b, n, ...)
    if moved.is_contiguous() and dtype in (None, x.dtype):
        pieces = moved
    else:
        pieces = torch.empty(moved.shape, dtype=dtype or x.dtype, device=x.device)
        pieces.copy_(moved)
    out = torch.empty(pieces.shape[1:], dtype=pieces.dtype, device=x.device)
    reduce_scatter_flat(out, pieces.reshape(size * b, *pieces.shape[2:]), group)
    return out


class _SequenceCollective(torch.autograd.Function):
    """`forward_op(x, group)` in forward, its adjoint `backward_op(grad, group)` in backward (the table above)."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad.contiguous(), ctx.group), None, None, None


class _GatheredLinears(torch.autograd.Function):
    """y_i = all_gather_seq(x) W_i^T + b_i for several (W_i, b_i) sharing one input (q and [k; v]), keeping only
    this rank's shard of x for backward: the gathered input is rebuilt by a second all-gather in backward
    (Megatron does the same), so the inputs of the projections are stored s / tp long, like the norm regions.
    Forward: one all-gather. Backward: one all-gather (x again) and one reduce-scatter (dx, summed over the
    outputs). Under autocast the matmuls run in its dtype, as F.linear's would, and keep the weights' casts."""

    @staticmethod
    def forward(ctx, x, group, n, *weights_and_biases):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        cast = (lambda t: t if t is None or dtype is None else t.to(dtype))  # noqa: E731
        pairs = [(cast(weights_and_biases[2 * i]), cast(weights_and_biases[2 * i + 1])) for i in range(n)]
        with torch.autocast(device, enabled=False):
            full = _gather(x, group, dtype)
            outs = tuple(F.linear(full, w, b) for w, b in pairs)
        ctx.group, ctx.n, ctx.dtype = group, n, dtype
        ctx.param_dtypes = [t.dtype if t is not None else None for t in weights_and_biases]
        ctx.has_bias = [b is not None for _, b in pairs]
        ctx.save_for_backward(x, *(w for w, _ in pairs))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = _gather(x, ctx.group, ctx.dtype)  # the input again, in the matmuls' dtype
        flat = full.reshape(-1, full.shape[-1])
        dx, out = None, []
        for i, (w, g) in enumerate(zip(weights, grads)):
            g = g.to(w.dtype)
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:  # summed over the outputs in place: no second (b s, d) buffer
                dx = g2.mm(w) if dx is None else dx.addmm_(g2, w)
            dw = g2.t().mm(flat).to(ctx.param_dtypes[2 * i]) if ctx.needs_input_grad[3 + 2 * i] else None
            db = g2.sum(0).to(ctx.param_dtypes[2 * i + 1]) \
                if ctx.has_bias[i] and ctx.needs_input_grad[4 + 2 * i] else None
            out += [dw, db]
        shape = (*full.shape[:-1], x.shape[-1])
        del full, flat  # the gathered input is not needed for the reduce-scatter
        if dx is not None:
            dx = _reduce_scatter(dx.view(shape), ctx.group, x.dtype)  # summed in x's dtype (fp32 under autocast)
        return (dx, None, None, *out)


class SequenceParallel:
    """The region boundaries of one model's tensor-parallel layers, sequence-parallel or not (module docstring).

    One instance per model, shared by its layers (as the TPRNGTracker is), so decoding can suspend it for all."""

    def __init__(self, group, enabled: bool):
        if enabled and group_size(group) == 1:
            raise ValueError("sequence parallelism needs a tensor-parallel group of 2 or more ranks")
        self.group, self.enabled = group, enabled

    @property
    def active(self) -> bool:
        return self.enabled and self.group is not None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a column-parallel layer: (b, s/tp, d) -> (b, s, d) all-gathered, or the identity (dx all-reduced)."""
        return _SequenceCollective.apply(x, self.group, _gather, _reduce_scatter) if self.active else copy_to_tp_region(x, self.group)

    def linears(self, x: torch.Tensor, *pairs: tuple[torch.Tensor, torch.Tensor | None]) -> list[torch.Tensor]:
        """Column-parallel projections of one input, [x W_i^T + b_i]: under sequence parallelism x is this rank's
        s / tp positions, all-gathered in forward and kept as the shard (_GatheredLinears); otherwise x enters
        the tp region once (copy_to_tp_region: identity, dx all-reduced in backward)."""
        if not self.active:
            x = copy_to_tp_region(x, self.group)
            return [F.linear(x, w, b) for w, b in pairs]
        return list(_GatheredLinears.apply(x, self.group, len(pairs), *(t for pair in pairs for t in pair)))

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel layer: partial sums (b, s, d) -> this rank's (b, s/tp, d) of their sum, or the
        all-reduced (b, s, d)."""
        return _SequenceCollective.apply(partial, self.group, _reduce_scatter, _gather) if self.active \
            else reduce_from_tp_region(partial, self.group)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated (b, s, d) -> this rank's (b, s/tp, d); the identity without sequence parallelism."""
        return _SequenceCollective.apply(x, self.group, _split, _gather) if self.active else x

    def replicated(self, param: torch.Tensor) -> torch.Tensor:
        """A tp-replicated parameter applied to this rank's positions: its gradient all-reduced over tp."""
        return copy_to_tp_region(param, self.group) if self.active else param

    @contextlib.contextmanager
    def suspended(self):
        """Plain tensor parallelism inside (decoding: a step's new tokens are not split over tp)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled


def plain(group) -> SequenceParallel:
    """The boundaries of plain tensor parallelism over `group` (what a layer built without one uses)."""
    return SequenceParallel(group, enabled=False)
