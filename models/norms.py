"""The block's normalisation: GPT-2's LayerNorm (through the kernel dispatch) or Llama's RMSNorm."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.kernels import Implementation, LayerNorm, ModelOp
from megazoo.kernels.layer_norm import (half_under_autocast, in_input_dtype, layer_norm_outside_autocast,
                                       layer_norm_torch)
from megazoo.models.config import ModelConfig
from megazoo.parallel.tensor import SequenceParallel, copy_to_tp_region


class _RMSNormFunction(torch.autograd.Function):
    """HF LlamaRMSNorm's arithmetic; backward recomputes the normalised input from x and the per-row 1/rms, so
    only those two are kept (as LayerNorm keeps its input and statistics), not the normalised copy autograd would
    keep for the weight's gradient (one more b x s x d tensor per norm)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        stats = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(stats.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (stats * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(rstd.dtype) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_normed = (grad * weight).to(rstd.dtype)
        # d/dx of x * rstd(x): rstd (g - n mean(g n)), n the normalised input
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32 (fp64 for fp64 inputs) and the weight applied
    in the input dtype, as Hugging Face's LlamaRMSNorm. No bias. Replicated over tp: every rank normalises the
    full hidden vector, so its gradient is identical on every tp rank."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None,
                 sequence_parallel: SequenceParallel | None = None):
        super().__init__()
        self.eps, self.sequence_parallel = eps, sequence_parallel
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.sequence_parallel is None else self.sequence_parallel.replicated(self.weight)
        if half_under_autocast(x):
            # As LayerNorm (kernels/layer_norm.py, layer_norm_outside_autocast): outside autocast, y in x's dtype.
            # Its explicit casts keep x, y and dx 16-bit already (autocast's fp32 ops here, pow and rsqrt, get
            # fp32 statistics); the cast only acts on an fp32 weight beside a 16-bit x, whose product promotes.
            with torch.autocast(x.device.type, enabled=False):
                return in_input_dtype(_RMSNormFunction.apply(x, weight, self.eps), x)
        return _RMSNormFunction.apply(x, weight, self.eps)


class HeadRMSNorm(RMSNorm):
    """Qwen3's per-head RMSNorm of q or k: one (head_dim,) weight for every head, replicated over tp while the heads
    are split, so each rank's gradient covers only its own heads: it is all-reduced over tp (copy_to_tp_region)."""

    def __init__(self, dim: int, eps: float, group, device=None, dtype=None):
        super().__init__(dim, eps=eps, device=device, dtype=dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., head_dim)
        weight = copy_to_tp_region(self.weight, self.group)
        if half_under_autocast(x):
            with torch.autocast(x.device.type, enabled=False):
                return in_input_dtype(_RMSNormFunction.apply(x, weight, self.eps), x)
        return _RMSNormFunction.apply(x, weight, self.eps)


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm over this rank's s / tp positions (sequence parallelism): the same parameters and arithmetic, the
    weight and bias passed through `replicated` so their partial gradients are all-reduced over tp in backward."""

    def __init__(self, dim: int, eps: float, *, fn, sequence_parallel: SequenceParallel, device=None, dtype=None):
        super().__init__(dim, eps=eps, fn=fn, device=device, dtype=dtype)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (p if p is None else self.sequence_parallel.replicated(p) for p in (self.weight, self.bias))
        if half_under_autocast(x):  # y in x's dtype, not CUDA autocast's fp32 (kernels/layer_norm.py)
            return layer_norm_outside_autocast(self.fn, x, weight, bias, self.eps)
        if self.fn is layer_norm_torch:  # nn.LayerNorm's own call, in x's dtype
            return in_input_dtype(F.layer_norm(x, self.normalized_shape, weight, bias, self.eps), x)
        return self.fn(x, weight, bias, self.eps)


def norm_ops(cfg: ModelConfig) -> tuple[ModelOp, ...]:
    """What make_norm builds for `cfg`, for the run log's kernels: lines (models/transformer.py: model_ops)."""
    if cfg.norm == "rmsnorm":
        return (ModelOp("rms_norm", fixed="models/norms.py RMSNorm (fp32 statistics; backward recomputes from 1/rms)"),)
    return (ModelOp("layer_norm", "layer_norm"),)


def make_norm(cfg: ModelConfig, kernels: Mapping[str, Implementation], device=None, dtype=None,
              sequence_parallel: SequenceParallel | None = None) -> nn.Module:
    """The config's norm; `sequence_parallel` (enabled): one that normalises this rank's positions only."""
    if not (sequence_parallel and sequence_parallel.enabled):
        sequence_parallel = None
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps, device=device, dtype=dtype,
                       sequence_parallel=sequence_parallel)
    if sequence_parallel is not None:
        return SequenceParallelLayerNorm(cfg.d_model, cfg.layer_norm_eps, fn=kernels["layer_norm"].fn,
                                         sequence_parallel=sequence_parallel, device=device, dtype=dtype)
    return LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, fn=kernels["layer_norm"].fn, device=device, dtype=dtype)
