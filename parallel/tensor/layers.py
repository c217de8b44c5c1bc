"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Every layer receives its tensor-parallel process group (None for tp = 1) and allocates only its own shard.
`shard_specs` maps each parameter name to its ShardSpec, which is all that initialisation, gathering full weights
and checkpoint conversion need to know about the layout.

Weights follow `torch.nn.Linear`'s (out_features, in_features) convention.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.parallel.tensor.comms import (gather_from_tp_region, reduce_from_tp_region,
                                   scatter_to_tp_region)
from megazoo.parallel.tensor.fp8 import fp8_linear
from megazoo.parallel.tensor.lora import column_delta, row_delta
from megazoo.parallel.tensor.sequence import SequenceParallel, plain
from megazoo.parallel.tensor.shards import ShardSpec
from megazoo.parallel.topology import group_rank, group_size


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} = {numerator} is not divisible by {denominator}")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split along its output rows: rank r computes y's columns for its rows.

    Forward: copy_to_tp_region (identity; all-reduce of dx in backward), local matmul, optionally all-gather
    of y. With `sections` > 1 the output is that many equal blocks (fused QKV), each split across ranks.
    `sequence_parallel` (parallel/tensor/sequence.py, active): x is this rank's s / tp positions, all-gathered
    along the sequence in forward (dx reduce-scattered in backward) in place of copy_to_tp_region.
    """

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = True, sections: int = 1,
                 gather_output: bool = False, init_std: float = 0.02, device=None, dtype=None,
                 sequence_parallel: SequenceParallel | None = None):
        super().__init__()
        self.sequence_parallel = sequence_parallel if sequence_parallel is not None else plain(group)
        tp, rank = group_size(group), group_rank(group)
        _divide(out_features, sections * tp, f"output features of a column-parallel layer (x {sections} sections)")
        if gather_output and sections > 1:
            raise ValueError("gather_output with sections > 1 would interleave the sections; gather per section")
        self.group, self.gather_output, self.init_std = group, gather_output, init_std
        self.in_features, self.out_features, self.sections = in_features, out_features, sections
        self.lora: nn.ModuleDict | None = None  # LoRA adapters (parallel/tensor/lora.py), set by models/lora/adapters.py
        self.fp8: str | None = None  # an FP8 recipe (parallel/tensor/fp8.py), set by enable_fp8
        self.shard_specs = {"weight": ShardSpec((out_features, in_features), 0, sections, rank, tp)}
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, device=device, dtype=dtype))
        if bias:
            self.shard_specs["bias"] = ShardSpec((out_features,), 0, sections, rank, tp)
            self.bias = nn.Parameter(torch.empty(out_features // tp, device=device, dtype=dtype))
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (..., in) -> (..., out/tp) or (..., out)
        if self.lora is None and self.fp8 is None:
            (y,) = self.sequence_parallel.linears(x, (self.weight, self.bias))
        else:  # the adapters (or FP8) read the entered (under sequence parallelism: gathered) x as well
            y = self.local(self.sequence_parallel.enter(x))
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def local(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """This rank's output slice for an input already in the tp region (no collective): W_r x (+ b_r), plus
        the LoRA adapters' slice when there are any. `bias=False` leaves the bias to a fused bias + GELU."""
        if self.fp8 is None:
            y = F.linear(x, self.weight, self.bias if bias else None)
        else:
            y = fp8_linear(x, self.weight, self.bias if bias else None, self.fp8, group=self.group, parallel="column")
        return y if self.lora is None else y + column_delta(self.lora, x, self.sections, y.shape[-1])


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split along its input columns: rank r multiplies its slice of x.

    Forward: (optional scatter of x), local matmul giving a partial sum, all-reduce over tp (identity in
    backward), then the replicated bias, added once after the reduction. `sequence_parallel` (active): a
    reduce-scatter along the sequence in place of the all-reduce (all-gather in backward), the bias added to this
    rank's positions and its gradient all-reduced over tp.
    """

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = True,
                 input_is_parallel: bool = True, init_std: float = 0.02, device=None, dtype=None,
                 sequence_parallel: SequenceParallel | None = None):
        super().__init__()
        self.sequence_parallel = sequence_parallel if sequence_parallel is not None else plain(group)
        tp, rank = group_size(group), group_rank(group)
        _divide(in_features, tp, "input features of a row-parallel layer")
        self.group, self.input_is_parallel, self.init_std = group, input_is_parallel, init_std
        self.in_features, self.out_features = in_features, out_features
        self.lora: nn.ModuleDict | None = None  # LoRA adapters (parallel/tensor/lora.py), set by models/lora/adapters.py
        self.fp8: str | None = None  # an FP8 recipe (parallel/tensor/fp8.py), set by enable_fp8
        self.shard_specs = {"weight": ShardSpec((out_features, in_features), 1, 1, rank, tp)}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, device=device, dtype=dtype))
        if bias:
            self.shard_specs["bias"] = ShardSpec((out_features,))
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (..., in/tp) -> (..., out)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        partial = F.linear(x, self.weight) if self.fp8 is None else \
            fp8_linear(x, self.weight, None, self.fp8, group=self.group, parallel="row")
        if self.lora is not None:  # the adapters' partial sums join the base's one all-reduce (reduce-scatter)
            partial = partial + row_delta(self.lora, x)
        y = self.sequence_parallel.leave(partial)
        return y + self.sequence_parallel.replicated(self.bias) if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split over tp ranks.

    Each rank looks up the ids in its range [start, end) and writes zeros for the rest; the all-reduce in
    forward (identity in backward) assembles full embeddings. `num_embeddings` must already be padded to a
    multiple of tp (we pad to 128 * tp).

    `tied_head=True`: the same weight is also the output head (`head`), used after the lookup in the same forward.
    Autograd would then hold three dense vocabulary x dim tensors for it at the end of backward: the head's
    gradient (waiting through the whole backward for the lookup's), the lookup's (zero except for the looked-up
    rows) and their sum (at d = 1280 with GPT-2's vocabulary, 257 MB each: where ZeRO-3's peak was; measured,
    and autograd does not add a sparse lookup gradient in place either). Instead the head's backward keeps its weight
    gradient aside and the lookup's backward adds its rows into it in place (Megatron's gradient-accumulation
    fusion, for this one weight): one dense gradient reaches the weight. Not under autocast, where the head reads a
    16-bit cast of the weight and its gradient must flow back through that cast.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group, *, init_std: float = 0.02,
                 device=None, dtype=None, tied_head: bool = False, sequence_parallel: SequenceParallel | None = None):
        super().__init__()
        # the tied head's input: all-gathered along the sequence under sequence parallelism (see head)
        self.sequence_parallel = sequence_parallel if sequence_parallel is not None else plain(group)
        self.tied_head = tied_head
        self._shared: _TiedGradient | None = None  # this forward's lookup -> its head
        tp, rank = group_size(group), group_rank(group)
        local = _divide(num_embeddings, tp, "padded vocabulary size")
        self.group, self.init_std = group, init_std
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end = rank * local, (rank + 1) * local
        self.shard_specs = {"weight": ShardSpec((num_embeddings, embedding_dim), 0, 1, rank, tp)}
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))

    def _fused(self) -> bool:
        return self.tied_head and torch.is_grad_enabled() and self.weight.requires_grad \
            and not torch.is_autocast_enabled(self.weight.device.type)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        self._shared = None
        if not self._fused():
            return F.embedding(ids, self.weight)
        self._shared = _TiedGradient()
        return _RowsLookup.apply(ids, self.weight, self._shared)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids (b, s) -> (b, s, h)
        if self.group is None:
            return self._lookup(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)  # row 0 gets zero rows in backward
        out = self._lookup(local_ids).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.group)

    def head(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> this rank's vocabulary shard (b, s, V/tp)
        """The tied output head, logits = x W^T. Collectives: none in forward; dx is summed over tp in backward
        (copy_to_tp_region). Sequence parallelism: x (b, s/tp, d) is all-gathered in forward, dx reduce-scattered."""
        x = self.sequence_parallel.enter(x)
        shared, self._shared = self._shared, None
        if shared is None or not self._fused():
            return F.linear(x, self.weight)
        return _HeadKeepingGradient.apply(x, self.weight, shared)


class _TiedGradient:
    """The tied weight's gradient between the head's backward and the lookup's (one per forward)."""

    grad: torch.Tensor | None = None


class _HeadKeepingGradient(torch.autograd.Function):
    """F.linear(x, W); backward returns dx and leaves dW (a fresh contiguous tensor) to the lookup's backward,
    which runs after it (the lookup's output is the head's input, through the blocks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, shared: _TiedGradient) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.shared = shared
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            ctx.shared.grad = grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return (grad.matmul(weight) if ctx.needs_input_grad[0] else None), None, None


class _RowsLookup(torch.autograd.Function):
    """F.embedding(ids, W); backward adds the looked-up rows' gradients into the head's dW in place."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, shared: _TiedGradient) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shared, ctx.weight_shape = shared, weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, rows: torch.Tensor):
        (ids,) = ctx.saved_tensors
        grad, ctx.shared.grad = ctx.shared.grad, None
        if grad is None:  # the head's backward did not run (or its weight gradient was not asked for)
            grad = rows.new_zeros(ctx.weight_shape)
        grad.index_add_(0, ids.reshape(-1), rows.reshape(-1, rows.shape[-1]).to(grad.dtype))
        return None, grad, None
