"""The layout bug `megazoo verify` must catch, planted by the verify tests: a column-parallel layer's input gradient
not all-reduced over tp in backward (every projection and the tied head enter the tp region through
parallel/tensor/sequence.py's copy_to_tp_region)."""

from __future__ import annotations

import torch

from megazoo.parallel.tensor import sequence


class _NoInputGradReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def plant_tp_input_grad_bug(monkeypatch) -> None:
    monkeypatch.setattr(sequence, "copy_to_tp_region",
                        lambda x, group: x if group is None else _NoInputGradReduce.apply(x, group))
