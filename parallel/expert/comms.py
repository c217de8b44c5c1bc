"""The communication of expert parallelism, over the ep group of the Topology.

| function          | forward                                              | backward                            |
|-------------------|------------------------------------------------------|-------------------------------------|
| exchange_counts   | all-to-all of per-expert token counts (equal splits) | none (counts have no gradient)      |
| all_to_all_uneven | all-to-all with uneven splits: rows to each ep rank  | the same all-to-all, splits swapped |
| from_first_rank   | broadcast from the ep group's first rank (decoding)  | none (token ids)                    |

`all_to_all_uneven` moves rows (tokens) of a [N, ...] tensor: the first in_splits[0] rows go to ep rank 0, the
next in_splits[1] to rank 1, ...; what arrives from rank j lands in rank order, out_splits[j] rows each. The
splits are host integers: a rank learns how many rows it will receive from `exchange_counts` first (one small
all-to-all and one device-to-host read per dispatch, the only host read of the MoE layer: the receive buffers'
sizes depend on where the router sent the tokens).

With a CommLedger, `all_to_all_uneven` counts what leaves this rank (rows for other ranks, not the rows it keeps)
under "all_to_all", in forward and in backward, and with the ledger's node_size per destination's link class
("all_to_all_intra" / "all_to_all_inter" in link_bytes: a row crosses nodes only when its destination is on another
node); `all_to_all_bytes` is the formula for uniform routing (tested to equal the count). A `None` group (ep = 1) makes both the identity, with no collective at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazoo.parallel.collectives import CommLedger
from megazoo.parallel.topology import group_rank, group_size


def all_to_all_bytes(tokens: int, top_k: int, d_model: int, ep: int, element_size: int, passes: int = 4) -> float:
    """Bytes one rank sends to other ranks per MoE layer when routing is uniform: T x k rows of d, (ep - 1) / ep
    of them leave, once per all-to-all; `passes` = 4 per training step (dispatch and combine, forward and
    backward; 6 with activation checkpointing's recomputed forward), 2 in inference."""
    return passes * tokens * top_k * (ep - 1) / ep * d_model * element_size


def _count(ledger: CommLedger | None, x: torch.Tensor, in_splits: list[int], group) -> None:
    if ledger is not None:
        me = group_rank(group)
        rows = sum(in_splits) - in_splits[me]  # the rows this rank keeps never travel
        row = x[0].numel() if x.shape[0] else 0
        n = rows * row
        ledger.elements["all_to_all"] += n
        ledger.bytes["all_to_all"] += n * x.element_size()
        ledger.calls["all_to_all"] += 1
        if ledger.node_size > 0:  # each row goes straight to its rank: by that rank's node, not the group's span
            ranks = dist.get_process_group_ranks(group)
            for j, count in enumerate(in_splits):
                if j != me and count:
                    link = "intra" if ranks[j] // ledger.node_size == ranks[me] // ledger.node_size else "inter"
                    ledger.link_bytes[f"all_to_all_{link}"] += count * row * x.element_size()


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [ep * n] (int64: rows this rank sends to each of rank j's n experts, rank-major) -> [ep * n]: the
    rows each rank j sends to this rank's n experts (rank-major). Collective: one all_to_all_single."""
    if group is None:
        return counts
    ep = group_size(group)
    if counts.numel() % ep:
        raise ValueError(f"{counts.numel()} expert counts are not divisible by the ep size {ep}")
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class _AllToAllUneven(torch.autograd.Function):
    """Forward: rows to their ep ranks. Backward: each row's gradient back to the rank it came from (the same
    collective with the splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, ledger):
        ctx.splits, ctx.group, ctx.ledger = (out_splits, in_splits), group, ledger
        _count(ledger, x, in_splits, group)
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        _count(ctx.ledger, grad, out_splits, ctx.group)
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None, None


def all_to_all_uneven(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                      ledger: CommLedger | None = None) -> torch.Tensor:
    """Send x's rows split by `in_splits` (one count per ep rank) and receive `out_splits` rows from each rank."""
    if group is None:
        return x
    ep = group_size(group)
    if len(in_splits) != ep or len(out_splits) != ep or sum(in_splits) != x.shape[0]:
        raise ValueError(f"all_to_all_uneven: splits {in_splits} -> {out_splits} do not fit {x.shape[0]} rows "
                         f"over {ep} ep ranks")
    return _AllToAllUneven.apply(x, list(out_splits), list(in_splits), group, ledger)


def from_first_rank(x: torch.Tensor, group) -> torch.Tensor:
    """x as the group's first rank holds it, on every rank of the group (in place; the identity for a None group).
    Decoding at ep > 1 sends the token the first ep rank chose: each ep rank computes its own logits (its own copy
    of the tokens routed over experts spread across the ranks), and a last-bit difference that picked another
    token would put the ranks' next all-to-alls out of step. Collective: one broadcast."""
    if group is not None:
        dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group)
    return x
