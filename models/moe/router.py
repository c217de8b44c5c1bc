"""The router: which experts each token goes to, and with what weight.

logits = x W_r^T computed in fp32 (fp64 when the run is fp64), and the scores from them in fp32: at bf16 the
softmax over many experts loses the small differences that decide the top-k, so every peer (Megatron's
moe_router_dtype, transformers' float softmax) routes in fp32. transformers scores in fp32 even in an fp64 model,
and so do we, so an fp64 export check matches it to 1e-10. Scoring "softmax" (Mixtral, Qwen2-MoE, Qwen3-MoE):
probabilities over all experts, the top-k of them, renormalised to sum 1 when norm_topk_prob (Mixtral always;
Qwen3-MoE by config) or kept as they are (Qwen2-MoE, DeepSeek-V2), then scaled by routed_scaling_factor
(DeepSeek-V2); DeepSeek-V2's group_limited_greedy keeps a token's experts in topk_group of n_group groups, a group
scored by its best probability (transformers' DeepseekV2TopkRouter). torch.topk picks the experts; equal probabilities keep torch.topk's order on every rank and layout,
since every layout scores the same token with the same fp32 arithmetic.

Scoring "sigmoid_bias" (DeepSeek-V3, Kimi K2; transformers' DeepseekV3TopkRouter): scores = sigmoid(logits);
the choice is made on scores + b, b (E,) a per-expert bias that is never in the weights and gets no gradient
(`Router.expert_bias`, a buffer), optionally limited to topk_group of n_group expert groups (a group's score: the
sum of its two best biased scores; the other groups' experts are masked to -inf) or to max_nodes of the nodes
the experts lie on (DeepSeek-V3's node limit: a node's score is the sum of its ceil(top_k / max_nodes) best);
the weights are the chosen experts' unbiased scores, renormalised when norm_topk_prob (+1e-20, as transformers) and scaled by
routed_scaling_factor. b moves after every optimizer step against the load (`update_expert_bias`): DeepSeek-V3's
auxiliary-loss-free balancing, b_e += rate x sign(mean load - load_e), the load being the step's assignments
counted over every rank that routes (block.py sums them over tp under sequence parallelism and over dp x cp, so
ep, which splits dp x cp, sees the same counts), so every layout moves b the same. The sign makes the update
blind to a uniform scale of the counts, so activation checkpointing's recomputed forward (which counts every
micro-batch of a layer twice) moves b as one forward does.

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


def route(logits: torch.Tensor, top_k: int, scoring: str = "softmax", norm_topk_prob: bool = True, *,
          bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          scaling: float = 1.0, nodes: int = 1, max_nodes: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights (T, k) fp32, indices (T, k) int64, probs (T, E) fp32) from router logits (T, E); "sigmoid_bias"
    takes the selection bias (E,), the group limit and the node limit (module docstring) and returns its sigmoid
    scores."""
    if scoring == "sigmoid_bias":
        return _sigmoid_bias(logits, top_k, norm_topk_prob, bias, n_group, topk_group, scaling, nodes, max_nodes)
    if scoring != "softmax":
        raise ValueError(f"model.moe_router = {scoring!r} is not built; valid: 'softmax', 'sigmoid_bias'")
    probs = torch.softmax(logits.float(), dim=-1)
    if n_group > 1:  # DeepSeek-V2's group_limited_greedy: a group's score is its best probability
        indices = torch.topk(_limit(probs.detach(), n_group, topk_group, 1), top_k, dim=-1).indices
        weights = probs.gather(1, indices)
    else:
        weights, indices = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * scaling if scaling != 1.0 else weights), indices, probs


def _limit(choice: torch.Tensor, groups: int, kept: int, best: int) -> torch.Tensor:
    """choice (T, E) with the experts outside each token's `kept` of `groups` equal groups masked to -inf, a
    group's score being the sum of its `best` highest entries."""
    rows, n_experts = choice.shape
    grouped = choice.view(rows, groups, n_experts // groups)
    group_scores = grouped.topk(min(best, grouped.shape[-1]), dim=-1).values.sum(-1)  # (T, groups)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(kept, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(rows, n_experts)


def _sigmoid_bias(logits, top_k, norm_topk_prob, bias, n_group, topk_group, scaling, nodes=1, max_nodes=0):
    scores = torch.sigmoid(logits.float())
    choice = scores.detach() + (bias.to(scores.dtype) if bias is not None else 0.0)  # selection only: no gradient
    if n_group > 1:  # transformers' group limit: a group's score is its two best
        choice = _limit(choice, n_group, topk_group, 2)
    if max_nodes:  # DeepSeek-V3's node limit: a node's score is its ceil(K / M) best (the report's K_r / M)
        choice = _limit(choice, nodes, max_nodes, -(-top_k // max_nodes))
    indices = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, indices, scores


@torch.no_grad()
def update_expert_bias(modules, rate: float) -> None:
    """After an optimizer step: every sigmoid_bias Router among `modules` moves its expert_bias by rate x
    sign(mean load - load) (module docstring) and clears the step's load."""
    for module in modules:
        if isinstance(module, Router) and module.expert_bias is not None:
            load = module.load.to(module.expert_bias.dtype)
            if rate:
                module.expert_bias += rate * torch.sign(load.mean() - load)
            module.load.zero_()


def materialize_router_buffers(modules, device) -> None:
    """A model built on the meta device (ZeRO-3 materialises parameters unit by unit, never buffers): every
    sigmoid_bias Router's expert_bias and load made real, at their initial zeros, on `device`."""
    for module in modules:
        if isinstance(module, Router) and module.expert_bias is not None and module.expert_bias.is_meta:
            module.expert_bias = torch.zeros_like(module.expert_bias, device=device)
            module.load = torch.zeros_like(module.load, device=device)


class Router(nn.Module):
    """W_r (E, d), replicated over tp. forward: x (T, d) -> logits (T, E) in fp32 (or wider)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, *, replicated=None):
        super().__init__()
        self.init_std = cfg.init_std
        self.replicated = replicated if replicated is not None else (lambda p: p)
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, device=device, dtype=dtype))
        if cfg.moe_router != "sigmoid_bias":
            self.expert_bias = None
        else:  # saved with the weights (transformers' e_score_correction_bias)
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, device=device, dtype=torch.float32))
            # the step's assignments per expert, over every routing rank; not saved (cleared after each step)
            self.register_buffer("load", torch.zeros(cfg.n_experts, device=device, dtype=torch.int64),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = router_dtype(x.dtype)
        weight = self.replicated(self.weight)
        with torch.autocast(x.device.type, enabled=False):  # autocast would run this matmul in 16 bits
            return F.linear(x.to(dtype), weight.to(dtype))
