"""The block's normalisation: GPT-2's LayerNorm (through the kernel dispatch) or Llama's RMSNorm."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from megazoo.kernels import Implementation, LayerNorm
from megazoo.models.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32 (fp64 for fp64 inputs) and the weight applied
    in the input dtype, as Hugging Face's LlamaRMSNorm. No bias. Replicated over tp: every rank normalises the
    full hidden vector, so its gradient is identical on every tp rank."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = stats * torch.rsqrt(stats.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def make_norm(cfg: ModelConfig, kernels: Mapping[str, Implementation], device=None, dtype=None) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps, device=device, dtype=dtype)
    return LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, fn=kernels["layer_norm"].fn, device=device, dtype=dtype)
