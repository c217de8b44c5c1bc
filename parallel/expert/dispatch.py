"""Token dispatch and combine for expert parallelism: every token goes to the ranks holding its top-k experts
and comes back weighted.

The num_experts experts are split over the ep ranks in contiguous blocks: ep rank r holds experts
[r * n, (r + 1) * n), n = num_experts / ep. One MoE layer's forward, for T tokens of width d routed to k experts:

1. permute: the T * k (token, expert) pairs sorted by expert (a stable sort: pairs of one expert keep token
   order, so every layout feeds an expert the same rows in the same order), which also sorts them by rank;
2. exchange counts: one all-to-all of the [num_experts] pair counts, so each rank learns how many rows each
   other rank sends to each of its n experts (the one host read of the layer: the split sizes; none when a
   capacity factor pads every expert to the same number of rows, exchange_rows' rows_per_expert);
3. all-to-all the rows (uneven splits); what arrives is ordered (source rank, local expert) and is regrouped
   to (local expert, source rank), so each local expert's rows are contiguous;
4. the local experts run on them: `experts_fn(rows, counts)` with one count per local expert (a grouped matmul
   or the per-expert loop: the caller's);
5. the inverse regroup, the inverse all-to-all, un-permute, and the weighted sum over each token's k experts.

Backward runs the same all-to-alls in reverse (comms.py). ep = 1 (group None) runs steps 1, 4 and 5 only: the
local dispatcher is this code with no collective. Volume per layer and direction: T * k * d elements leave each
rank, (ep - 1) / ep of them to other ranks with uniform routing. On the dry run's fake tensors (no values to
route by) the splits are the uniform ones, so the counted bytes equal comms.all_to_all_bytes exactly.
"""

from __future__ import annotations

from typing import Callable

import torch

from megazoo.parallel.collectives import CommLedger
from megazoo.parallel.expert.comms import all_to_all_uneven, exchange_counts
from megazoo.parallel.simulation.fake_world import has_values
from megazoo.parallel.topology import group_rank, group_size

# rows [N, d] sorted by local expert, counts [n] int64 (one per local expert, summing to N) -> rows [N, d_out]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_expert_split(num_experts: int, ep: int) -> int:
    """Experts per ep rank, or a ValueError naming parallel.ep when ep does not divide the experts."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"parallel.ep = {ep!r} is invalid: it must be a positive integer")
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"parallel.ep = {ep} does not divide the model's {num_experts} routed experts; "
                         f"valid: {divisors}")
    return num_experts // ep


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _rank_major_to_expert_major(received: torch.Tensor, total: int) -> torch.Tensor:
    """received [ep, n] row counts (source rank, local expert), laid out rank-major in the receive buffer, `total`
    their sum (a host integer: the output sizes below are given, so nothing is read back) -> the permutation of the
    buffer's rows that makes it expert-major (local expert, then source rank)."""
    lengths = received.t().reshape(-1)  # segments in expert-major order
    starts = (torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)).view(received.shape).t().reshape(-1)
    seg_starts_out = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(total, device=received.device) - torch.repeat_interleave(seg_starts_out, lengths,
                                                                                  output_size=total)
    return torch.repeat_interleave(starts, lengths, output_size=total) + within


def exchange_rows(rows: torch.Tensor, counts: torch.Tensor, experts_fn: ExpertsFn, group=None,
                  ledger: CommLedger | None = None, rows_per_expert: int | None = None) -> torch.Tensor:
    """rows [N, d] sorted by global expert, counts [num_experts] (rows per expert) -> [N, d_out]: each row through
    its expert, wherever that expert lives, in the same order (steps 2-5 above without the combine). This is the
    experts callable of a dispatcher that sorts and combines itself (models/moe/dispatch.py). `ledger` counts the
    rows' all-to-all bytes (comms.py).

    Host reads: the uneven all-to-all needs its split sizes on the host, so a layer reads its counts and the
    exchanged ones once, in one `.tolist()` (as torchtitan's and Megatron-core's all-to-all dispatchers do: one
    device-to-host copy per MoE layer forward; backward reuses the sizes). Everything after it is sized from those
    host integers. `rows_per_expert` (a capacity factor's padded slots, the same on every ep rank): every split is
    known without looking, so there is no count exchange and no host read at all."""
    ep = group_size(group)
    num_experts = counts.numel()
    n_local = check_expert_split(num_experts, ep)
    if group is None:
        return experts_fn(rows, counts)
    if rows_per_expert is not None:  # static: every rank sends every expert exactly rows_per_expert rows
        split = [n_local * rows_per_expert] * ep
        arrived = all_to_all_uneven(rows, split, split, group, ledger)
        received = torch.full((ep, n_local), rows_per_expert, dtype=counts.dtype, device=counts.device)
        regroup = _rank_major_to_expert_major(received, ep * n_local * rows_per_expert)
        computed = experts_fn(arrived.index_select(0, regroup), received.sum(0))
        return all_to_all_uneven(computed.index_select(0, _inverse(regroup)), split, split, group, ledger)
    received = exchange_counts(counts, group)  # [ep * n]: rows each rank sends to my experts
    if not has_values(rows):  # the dry run's fake tensors: no routing to read, so uniform routing (the planner's)
        even = [rows.shape[0] // ep + (r < rows.shape[0] % ep) for r in range(ep)]
        arrived = all_to_all_uneven(rows, even, even, group, ledger)
        computed = experts_fn(arrived, received.view(ep, n_local).sum(0))
        return all_to_all_uneven(computed, even, even, group, ledger)
    send, recv = split_sizes(counts, received, ep)  # the layer's one device-to-host read: every split size
    arrived = all_to_all_uneven(rows, recv, send, group, ledger)  # (source rank, local expert) order
    received = received.view(ep, n_local)
    regroup = _rank_major_to_expert_major(received, sum(recv))
    computed = experts_fn(arrived.index_select(0, regroup), received.sum(0))
    return all_to_all_uneven(computed.index_select(0, _inverse(regroup)), send, recv, group, ledger)


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts_fn: ExpertsFn,
                     num_experts: int, group=None, ledger: CommLedger | None = None) -> torch.Tensor:
    """x [T, d], weights [T, k], indices [T, k] (expert ids in [0, num_experts)) -> [T, d_out]: for each token
    the sum over its k experts of weight x expert(token), the experts living on the ranks of `group` (None: all
    local). Differentiable in x, weights and whatever `experts_fn` closes over."""
    order, counts = sort_by_expert(indices, num_experts)
    rows = x.index_select(0, order // indices.shape[1])  # [T * k, d], sorted by expert
    return combine_pairs(exchange_rows(rows, counts, experts_fn, group, ledger), order, weights)


def sort_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [T, k] -> (the stable order that sorts the T * k (token, expert) pairs by expert, pair p being token
    p // k's (p % k)-th expert; the rows per expert [num_experts], a bincount with a static shape)."""
    flat = indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def combine_pairs(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out [T * k, d_out] in expert order (`order`, sort_by_expert's) -> [T, d_out]: each token's k expert outputs
    weighted by weights [T, k] and summed."""
    t, k = weights.shape
    pairs = out.index_select(0, _inverse(order))  # back to pair order
    return (pairs.view(t, k, pairs.shape[-1]) * weights.to(pairs.dtype).unsqueeze(-1)).sum(1)


def split_sizes(counts: torch.Tensor, received: torch.Tensor, ep: int) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each ep rank, rows it receives from each) from its counts per global expert and the
    exchanged ones [ep * n]: the layer's one device-to-host read."""
    n, num_experts = received.numel() // ep, counts.numel()
    host = torch.cat([counts, received.reshape(-1)]).tolist()
    send = [sum(host[r * n:(r + 1) * n]) for r in range(ep)]
    recv = [sum(host[num_experts + r * n:num_experts + (r + 1) * n]) for r in range(ep)]
    return send, recv


def host_row_counts(counts: torch.Tensor, rows: int) -> list[int]:
    """The rows of each expert as host integers (a per-expert loop's split sizes: one host read), or, on the dry
    run's fake tensors (no values to read), `rows` split evenly: the uniform routing the planner assumes, as the
    all-to-all's splits above."""
    if has_values(counts):
        return counts.tolist()
    n = counts.numel()
    return [rows // n + (e < rows % n) for e in range(n)]


def local_expert_range(num_experts: int, group=None) -> range:
    """The global ids of the experts this rank of `group` holds: a contiguous block of num_experts / ep."""
    n = check_expert_split(num_experts, group_size(group))
    return range(group_rank(group) * n, (group_rank(group) + 1) * n)


class ExpertDispatcher:
    """The token dispatcher of an MoE layer whose experts are split over `group` (the Topology's ep group;
    None: every expert local). `local_experts` is the range of global expert ids this rank holds; `comm` counts
    its all-to-all bytes."""

    def __init__(self, num_experts: int, group=None):
        self.num_experts, self.group = num_experts, group
        self.local_experts = local_expert_range(num_experts, group)
        self.comm = CommLedger()

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 experts_fn: ExpertsFn) -> torch.Tensor:
        return dispatch_combine(x, weights, indices, experts_fn, self.num_experts, self.group, self.comm)
