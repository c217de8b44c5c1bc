"""The sub-groups the Topology builds beside its mesh dimensions: expert parallelism's ep / edp groups and the
node groups of HSDP and hpZ. Each is created on every rank in the same order (new_group is collective).
"""

from __future__ import annotations

import torch.distributed as dist

def check_expert_layout(ep: int, dp: int, cp: int = 1) -> None:
    """A ValueError naming parallel.ep when it is not a positive divisor of dp x cp (ep is carved out of them)."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"parallel.ep = {ep!r} is invalid: it must be a positive integer")
    if (dp * cp) % ep:
        valid = [d for d in range(1, dp * cp + 1) if dp * cp % d == 0]
        raise ValueError(f"parallel.ep = {ep} does not divide parallel.dp x parallel.cp = {dp} x {cp} = {dp * cp} "
                         f"(expert parallelism is carved out of them); valid: {valid}")


def _expert_groups(grid, ep: int, coords: tuple[int, int, int, int]):
    """(ep group, expert-data-parallel group) of the rank at `coords` in `grid`: within each (pp, tp) position's
    dp x cp ranks (grad rank order, dp-major), consecutive runs of ep ranks, and every ep-th rank. Created by
    every rank in the same order (new_group is collective); a group of one is None."""
    pp, dp, cp, tp = grid.shape
    if ep == 1:
        return None, None
    edp = dp * cp // ep
    ep_group = edp_group = None
    p0, d0, c0, t0 = coords
    mine = d0 * cp + c0
    for p in range(pp):
        for t in range(tp):
            ranks = [int(r) for r in grid[p, :, :, t].flatten()]
            for k in range(edp):
                created = dist.new_group(ranks[k * ep:(k + 1) * ep], group_desc="ep")
                if (p, t) == (p0, t0) and mine // ep == k:
                    ep_group = created
            if edp > 1:
                for j in range(ep):
                    created = dist.new_group(ranks[j::ep], group_desc="edp")
                    if (p, t) == (p0, t0) and mine % ep == j:
                        edp_group = created
    return ep_group, edp_group


def _node_groups(grid, per_node: int, coords: tuple[int, int, int, int], dp_group):
    """(intra, inter) dp groups of the rank at `coords` = (pp, dp, cp, tp) in `grid` (global ranks). When the
    whole dp group fits in a node it is the intra group (inter: None); with one dp rank per node, the inter one.
    Otherwise new groups, created by every rank in the same order (new_group is collective)."""
    pp, dp, cp, tp = grid.shape
    if per_node >= dp:
        return dp_group, None
    if per_node == 1:
        return None, dp_group
    intra = inter = None
    p0, d0, c0, t0 = coords
    for p in range(pp):
        for c in range(cp):
            for t in range(tp):
                mine = (p, c, t) == (p0, c0, t0)
                for k in range(dp // per_node):  # node k's dp ranks: consecutive indices
                    created = dist.new_group([int(r) for r in grid[p, k * per_node:(k + 1) * per_node, c, t]])
                    if mine and d0 // per_node == k:
                        intra = created
                for j in range(per_node):  # node-local position j on every node: every per_node-th index
                    created = dist.new_group([int(r) for r in grid[p, j::per_node, c, t]])
                    if mine and d0 % per_node == j:
                        inter = created
    return intra, inter


def _node_dp_cp_group(grid, per_node: int, coords: tuple[int, int, int], dp_cp_group, cp_group):
    """The dp x cp ranks on the node of the rank at `coords` = (pp, dp, tp): the whole dp x cp group when dp
    fits in a node, the cp group with one dp rank per node, else new groups (created by every rank, in order)."""
    pp, dp, cp, tp = grid.shape
    if per_node >= dp:
        return dp_cp_group if dp > 1 else cp_group
    if per_node == 1:
        return cp_group
    mine = None
    for p in range(pp):
        for t in range(tp):
            for k in range(dp // per_node):
                created = dist.new_group([int(r) for r in grid[p, k * per_node:(k + 1) * per_node, :, t].flatten()])
                if (p, t) == (coords[0], coords[2]) and coords[1] // per_node == k:
                    mine = created
    return mine
