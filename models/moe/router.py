"""The router: which experts each token goes to, and with what weight.

logits = x W_r^T computed in fp32 (fp64 when the run is fp64), and the scores from them in fp32: at bf16 the
softmax over many experts loses the small differences that decide the top-k, so every peer (Megatron's
moe_router_dtype, transformers' float softmax) routes in fp32. transformers scores in fp32 even in an fp64 model,
and so do we, so an fp64 export check matches it to 1e-10. Scoring "softmax" (Mixtral, Qwen2-MoE, Qwen3-MoE):
probabilities over all experts, the top-k of them, renormalised to sum 1 when norm_topk_prob (Mixtral always;
Qwen3-MoE by config) or kept as they are (Qwen2-MoE). torch.topk picks the experts; equal probabilities keep torch.topk's order on every rank and layout,
since every layout scores the same token with the same fp32 arithmetic.

W_r is replicated over tp; under sequence parallelism each tp rank routes its own positions, so the weight passes
through `replicated` (gradient all-reduced over tp).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.models.config import ModelConfig


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or wider when the model is (fp64 parity runs)."""
    return torch.promote_types(dtype, torch.float32)


def route(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
          norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights (T, k) fp32, indices (T, k) int64, probs (T, E) fp32) from router logits (T, E)."""
    if scoring != "softmax":
        raise ValueError(f"model.moe_router = {scoring!r} is not built; valid: 'softmax'")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices, probs


class Router(nn.Module):
    """W_r (E, d), replicated over tp. forward: x (T, d) -> logits (T, E) in fp32 (or wider)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, *, replicated=None):
        super().__init__()
        self.init_std = cfg.init_std
        self.replicated = replicated if replicated is not None else (lambda p: p)
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = router_dtype(x.dtype)
        weight = self.replicated(self.weight)
        with torch.autocast(x.device.type, enabled=False):  # autocast would run this matmul in 16 bits
            return F.linear(x.to(dtype), weight.to(dtype))
