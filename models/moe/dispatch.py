"""The token dispatcher: tokens sorted by expert, run by the local experts, combined back (ep = 1: all local).

The interface (what parallel/expert/'s all-to-all dispatcher implements too) is written down in
models/moe/__init__.py. LocalDispatcher, for T tokens each routed to k experts:

    1. flatten the T x k assignments and sort them by expert, stably (a token's rows keep token order inside an
       expert), so expert e's rows are one contiguous block; counts = assignments per expert (bincount);
    2. capacity factor (optional): an expert keeps its first `capacity` rows in token order and drops the rest
       (their contribution is 0, as GShard / Switch; the token still has the residual and the shared experts);
    3. the experts run on the sorted rows (one grouped matmul, experts.py);
    4. combine: out[t] += weight(t, e) * y(t, e), added in expert order per token (transformers' order).

Nothing is read on the host in the dropless path; the capacity path selects the kept rows with a boolean mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from megazoo.models.config import ModelConfig
from megazoo.models.moe.experts import ExpertComputation, capacity
from megazoo.parallel.expert import CommLedger, exchange_rows, local_expert_range
from megazoo.parallel.topology import Topology

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens sorted by expert, counts) -> outputs


@dataclass
class Dispatched:
    out: torch.Tensor  # (T, d) combined expert outputs, in x's dtype
    counts: torch.Tensor  # (E,) int64: assignments routed to each global expert, before dropping
    dropped: torch.Tensor  # () int64: assignments dropped by the capacity factor


class TokenDispatcher(Protocol):
    """models/moe/__init__.py: the seam expert parallelism plugs into."""

    local_experts: range

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 experts: Experts) -> Dispatched: ...


def sort_by_expert(indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order (T k,), counts (E,)): order lists the flattened assignments expert by expert (stable: token order
    inside an expert); assignment a is token a // k's choice a % k."""
    flat = indices.reshape(-1)
    # a scatter-add, not bincount: its (E,) shape does not depend on the values (fake tensors, the dry run)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def within_capacity(sorted_experts: torch.Tensor, counts: torch.Tensor, cap: int) -> torch.Tensor:
    """(T k,) bool over the sorted assignments: True for the first `cap` rows of each expert."""
    starts = torch.cumsum(counts, 0) - counts  # first sorted row of each expert
    rank = torch.arange(sorted_experts.numel(), device=sorted_experts.device) - starts[sorted_experts]
    return rank < cap


class LocalDispatcher:
    """Every expert on this rank (ep = 1). `capacity_factor` 0: dropless."""

    def __init__(self, n_experts: int, capacity_factor: float = 0.0):
        self.n_experts, self.capacity_factor = n_experts, capacity_factor
        self.local_experts = range(n_experts)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 experts: Experts) -> Dispatched:
        k = indices.shape[1]
        order, counts = sort_by_expert(indices, self.n_experts)
        token = order // k  # (T k,) the token of each sorted row
        weight = weights.reshape(-1)[order]
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        kept_counts = counts
        if self.capacity_factor:
            cap = capacity(self.capacity_factor, x.shape[0], k, self.n_experts)
            keep = within_capacity(indices.reshape(-1)[order], counts, cap)
            token, weight = token[keep], weight[keep]
            kept_counts = counts.clamp(max=cap)
            dropped = counts.sum() - kept_counts.sum()
        y = experts(x[token], kept_counts)  # (N, d), sorted by expert
        out = torch.zeros_like(x).index_add_(0, token, (y * weight[:, None]).to(x.dtype))
        return Dispatched(out, counts, dropped)


class ExpertParallelDispatcher(LocalDispatcher):
    """ep > 1: this rank holds local_experts of the ep group's split; sorting, dropping and the combine are the
    local dispatcher's, and the sorted rows travel to their experts' ranks and back in between (parallel/expert:
    counts exchanged, all-to-all with uneven splits, the local experts, the inverse all-to-all)."""

    def __init__(self, n_experts: int, capacity_factor: float, group, node_size: int = 0):
        super().__init__(n_experts, capacity_factor)
        self.group = group
        self.local_experts = local_expert_range(n_experts, group)
        # this layer's all-to-all bytes (parallel/expert/comms.py), per link class when nodes are known
        self.comm = CommLedger(node_size=node_size)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 experts: Experts) -> Dispatched:
        return super().__call__(x, weights, indices,
                                lambda rows, counts: exchange_rows(rows, counts, experts, self.group, self.comm))


def make_dispatcher(cfg: ModelConfig, topo: Topology) -> TokenDispatcher:
    """The dispatcher of this rank's MoE layers: local at ep = 1, the all-to-all one over the ep group."""
    if topo.ep > 1:
        return ExpertParallelDispatcher(cfg.n_experts, cfg.moe_capacity_factor, topo.ep_group, topo.node_size)
    return LocalDispatcher(cfg.n_experts, cfg.moe_capacity_factor)


def expert_parameter_names(model: nn.Module) -> set[str]:
    """The names of the routed experts' parameters (split over ep ranks; their gradients reduced over the
    expert-data-parallel group, parallel/expert/zero.py)."""
    return {f"{m}.{p}" if m else p for m, module in model.named_modules() if isinstance(module, ExpertComputation)
            for p, _ in module.named_parameters()}
