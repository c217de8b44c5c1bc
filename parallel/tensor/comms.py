"""The four autograd communication functions of tensor parallelism (Megatron-LM's f / g operators).

Each is a pair: what runs in forward, and its adjoint in backward. All act on the tensor-parallel group; a
`None` group (tp = 1) makes every one of them the identity, with no collective at all.

| function                  | forward                      | backward                     |
|---------------------------|------------------------------|------------------------------|
| copy_to_tp_region         | identity                     | all-reduce (sum)             |
| reduce_from_tp_region     | all-reduce (sum)             | identity                     |
| scatter_to_tp_region      | split last dim, keep own     | all-gather along last dim    |
| gather_from_tp_region     | all-gather along last dim    | split last dim, keep own     |
"""

from __future__ import annotations

import torch

from megazoo.parallel.collectives import all_gather_stacked, all_reduce
from megazoo.parallel.topology import group_rank, group_size


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[-1] % size:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    # The flat all-gather stacks along dim 0; gather there, then lay the ranks' pieces side by side.
    return torch.cat(all_gather_stacked(x, group, size).unbind(0), dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.group is None else all_reduce(grad.clone().contiguous(), ctx.group)), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone().contiguous(), group) if group is not None else x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: forward identity, backward all-reduce of the input gradient."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a row-parallel region: forward all-reduce of partial sums, backward identity."""
    return x if group is None else _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the chunks' gradients."""
    return x if group is None else _ScatterToTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of the gradient."""
    return x if group is None else _GatherFromTP.apply(x, group)
