"""The token dispatcher: tokens sorted by expert, run by the local experts, combined back (ep = 1: all local).

The interface (what parallel/expert/'s all-to-all dispatcher implements too) is written down in
models/moe/__init__.py. LocalDispatcher, for T tokens each routed to k experts:

    1. flatten the T x k assignments and sort them by expert, stably (a token's rows keep token order inside an
       expert), so expert e's rows are one contiguous block; counts = assignments per expert (bincount);
    2. capacity factor (optional): an expert keeps its first `capacity` rows in token order and drops the rest
       (their contribution is 0, as GShard / Switch; the token still has the residual and the shared experts);
       the kept rows sit in `capacity` padded slots per expert (static shapes: the experts compute the padding);
    3. the experts run on the sorted rows (one grouped matmul, experts.py);
    4. combine: out[t] += weight(t, e) * y(t, e), added in expert order per token (transformers' order).

Nothing is read on the host, dropless or with a capacity factor (its padded slots have a static shape).
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
                 experts: Experts, same_shapes: bool = False) -> Dispatched: ...


def sort_by_expert(indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order (T k,), counts (E,)): order lists the flattened assignments expert by expert (stable: token order
    inside an expert); assignment a is token a // k's choice a % k."""
    flat = indices.reshape(-1)
    # a scatter-add, not bincount: its (E,) shape does not depend on the values (fake tensors, the dry run)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def capacity_slots(sorted_experts: torch.Tensor, counts: torch.Tensor, cap: int) -> torch.Tensor:
    """(T k,) int64 over the sorted assignments: the slot of each row in a buffer of n_experts x cap rows (expert
    e's first `cap` rows, in token order, at e x cap ...), or n_experts x cap (one past the end) for a dropped row."""
    starts = torch.cumsum(counts, 0) - counts  # first sorted row of each expert
    rank = torch.arange(sorted_experts.numel(), device=sorted_experts.device) - starts[sorted_experts]
    return torch.where(rank < cap, sorted_experts * cap + rank, counts.numel() * cap)


def combine_sorted(x: torch.Tensor, y: torch.Tensor, token: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The combine: each sorted row's expert output y (N, d) times its weight (N,), added into its token's row of
    a (T, d) zero tensor in x's dtype. Also the forward/backward overlap's (recipes/training/model_setup.py), so
    that the two run the same ops in the same dtypes (bit-equal under autocast)."""
    return torch.zeros_like(x).index_add_(0, token, (y * weight[:, None]).to(x.dtype))


class LocalDispatcher:
    """Every expert on this rank (ep = 1). `capacity_factor` 0: dropless."""

    def __init__(self, n_experts: int, capacity_factor: float = 0.0):
        self.n_experts, self.capacity_factor = n_experts, capacity_factor
        self.local_experts = range(n_experts)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 experts: Experts, same_shapes: bool = False) -> Dispatched:
        k = indices.shape[1]
        order, counts = sort_by_expert(indices, self.n_experts)
        token = order // k  # (T k,) the token of each sorted row
        weight = weights.reshape(-1)[order]
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        kept_counts, cap = counts, None
        if self.capacity_factor:
            # Static shapes (no host read, fake tensors too): every expert gets `cap` slots, as GShard's and
            # Megatron's padded capacity; its kept rows fill the first ones in token order, the rest are padding
            # (token 0 at weight 0: adds exactly nothing, gets no gradient); a dropped row goes to a slot past the
            # end, cut off.
            cap = capacity(self.capacity_factor, x.shape[0], k, self.n_experts)
            slots = self.n_experts * cap
            slot = capacity_slots(indices.reshape(-1)[order], counts, cap)
            token = torch.zeros(slots + 1, dtype=token.dtype, device=x.device).scatter(0, slot, token)[:slots]
            weight = weight.new_zeros(slots + 1).scatter(0, slot, weight)[:slots]
            kept_counts = torch.full_like(counts, cap)
            dropped = counts.sum() - counts.clamp(max=cap).sum()
        y = self._experts(experts, x[token], kept_counts, cap if same_shapes else None)  # (N, d), by expert
        return Dispatched(combine_sorted(x, y, token, weight), counts, dropped)

    def _experts(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor, cap: int | None) -> torch.Tensor:
        return experts(rows, counts)


class ExpertParallelDispatcher(LocalDispatcher):
    """ep > 1: this rank holds local_experts of the ep group's split; sorting, dropping and the combine are the
    local dispatcher's, and the sorted rows travel to their experts' ranks and back in between (parallel/expert:
    counts exchanged, all-to-all with uneven splits, the local experts, the inverse all-to-all). With a capacity
    factor and `same_shapes` (training: every ep rank routes as many rows, so has the same capacity) the padded
    slots make every split known: no count exchange and no host read (exchange_rows' rows_per_expert)."""

    def __init__(self, n_experts: int, capacity_factor: float, group, node_size: int = 0):
        super().__init__(n_experts, capacity_factor)
        self.group = group
        self.local_experts = local_expert_range(n_experts, group)
        # this layer's all-to-all bytes (parallel/expert/comms.py), per link class when nodes are known
        self.comm = CommLedger(node_size=node_size)

    def _experts(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor, cap: int | None) -> torch.Tensor:
        return exchange_rows(rows, counts, experts, self.group, self.comm, rows_per_expert=cap)


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
