"""Over which ranks ZeRO partitions, and over which the partitions are then combined: flat, HSDP or hpZ.

  flat ("dp")   every stage partitions over all dp x cp ranks: a bucket's gradient is reduce-scattered and its
                parameters all-gathered over the whole group, across nodes when it spans them.
  HSDP ("node") stages 1-3 partition over the dp (x cp) ranks of one node only (`Topology.dp_cp_intra_group`;
                cp ranks hold the same parameters and a node holds whole cp groups); each node
                holds a full replica of the partitioned states. backward: reduce-scatter inside the node, then
                all-reduce the owned gradient chunk over the same chunk's owners on the other nodes
                (`dp_inter_group`), once per optimizer step whatever the gradient accumulation (stages 2-3
                add each micro-batch's node sum into the owned chunk; the last backward sends it across, in
                the owned chunk's fp32 when there were several micro-batches, GradientReducer in
                partitioned.py). step / stage-3 gathers: inside the node. Cross-node traffic per step:
                2 x (params / per_node) x (nodes - 1) / nodes elements (one all-reduce of a chunk), instead of
                2 (stages 1-2) or 3 (stage 3) x params x (dp - 1) / dp. Costs: states per_node times, not dp
                times, smaller.
  hpZ           stage 3 only (ZeRO++, Wang et al. 2023; DeepSpeed's zero_hpz_partition_size): the primary
                partition stays flat over dp (optimizer states, gradients); the forward's all-gather over dp also
                leaves each rank a secondary copy of its node-local 1/per_node of the unit, and the backward's
                all-gather runs inside the node from those secondaries. Cross-node: 2 x params x (dp - 1) / dp
                per micro-batch (forward gather + gradient reduce-scatter) instead of 3; memory: + params /
                per_node per rank for the secondaries held from a unit's forward to its backward.

Exact: every layout sums the same gradients (in a different order) and applies the same AdamW update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megazoo.parallel.topology import Topology

SHARD_GROUPS = ("dp", "node")


@dataclass(frozen=True)
class ShardGroups:
    """The partition of one ZeRO optimizer: `shard_*` where the chunks of a bucket live, `replica_*` the other
    nodes holding the same chunk (HSDP), `secondary_*` the node group of hpZ's backward gather."""

    shard_group: dist.ProcessGroup | None = None
    shard_size: int = 1
    shard_rank: int = 0
    replica_group: dist.ProcessGroup | None = None  # HSDP: all-reduce of the owned gradient chunk across nodes
    replica_size: int = 1
    replica_rank: int = 0
    secondary_group: dist.ProcessGroup | None = None  # hpZ: the node's dp ranks
    secondary_size: int = 1
    secondary_rank: int = 0
    hpz: bool = False
    quantized_gradients: str = "none"  # qgZ (qgz.py): "int8" | "int4" hierarchical reduce instead of the flat one

    @property
    def reduce_size(self) -> int:
        """How many ranks' gradients are averaged: every dp x cp rank, in all layouts."""
        return self.shard_size * self.replica_size


def check_shard_choice(shard_group: str, hpz: bool, stage: int, cp: int = 1, quantized_weights: bool = False,
                       quantized_gradients: str = "none", offload: str = "none") -> None:
    """A ValueError naming the field when zero.shard_group / zero.hpz / zero.quantized_weights /
    zero.quantized_gradients do not fit the stage and layout."""
    check_quantized_gradients(quantized_gradients, stage, shard_group, cp, offload)
    if quantized_weights and stage != 3:
        raise ValueError(f"zero.quantized_weights = true needs zero.stage = 3 (got {stage}): only stage 3 gathers "
                         "parameters for compute (stages 1-2 gather the updated masters themselves)")
    if shard_group not in SHARD_GROUPS:
        raise ValueError(f"zero.shard_group = {shard_group!r} is invalid; valid: {', '.join(map(repr, SHARD_GROUPS))}")
    if shard_group == "node" and stage == 0:
        raise ValueError("zero.shard_group = 'node' needs zero.stage 1, 2 or 3 (stage 0 partitions nothing)")
    if hpz and stage != 3:
        raise ValueError(f"zero.hpz = true needs zero.stage = 3 (got {stage}): only stage 3 gathers parameters "
                         "in backward")
    if hpz and shard_group == "node":
        raise ValueError("zero.hpz = true with zero.shard_group = 'node' is redundant (HSDP already gathers inside "
                         "a node); valid: one of them")


def check_quantized_gradients(bits: str, stage: int, shard_group: str = "dp", cp: int = 1,
                              offload: str = "none") -> None:
    """zero.quantized_gradients (qgZ, qgz.py) fits: a valid value, a stage that reduce-scatters gradients over
    the flat dp group, no cp (the hierarchy is built over dp ranks only), no offload."""
    valid = ("none", "int8", "int4")
    if bits not in valid:
        raise ValueError(f"zero.quantized_gradients = {bits!r} is invalid; valid: {', '.join(map(repr, valid))}")
    if bits == "none":
        return
    if stage not in (1, 2, 3):
        raise ValueError(f"zero.quantized_gradients = {bits!r} needs zero.stage 1, 2 or 3 (got {stage}): stage 0 "
                         "all-reduces gradients, there is no reduce-scatter to replace")
    if shard_group != "dp":
        raise ValueError(f"zero.quantized_gradients = {bits!r} needs zero.shard_group = 'dp' (got {shard_group!r}):"
                         " HSDP reduce-scatters inside the node only; valid: flat ZeRO or zero.hpz")
    if cp > 1:
        raise ValueError(f"zero.quantized_gradients = {bits!r} needs parallel.cp = 1 (got {cp})")
    if offload != "none":
        raise ValueError(f"zero.quantized_gradients = {bits!r} with zero.offload = {offload!r} is not supported; "
                         "valid: zero.offload = 'none'")


def shard_groups(topo: Topology, shard_group: str = "dp", hpz: bool = False, stage: int = 3,
                 quantized_gradients: str = "none") -> ShardGroups:
    """The ShardGroups of `topo` for zero.shard_group / zero.hpz / zero.quantized_gradients, or a ValueError
    naming the field."""
    check_shard_choice(shard_group, hpz, stage, topo.cp, quantized_gradients=quantized_gradients)
    # The node group: this node's dp ranks x every cp rank (cp ranks hold the same parameters and a node holds
    # whole cp groups, Topology.build), as flat ZeRO partitions over dp x cp. The replicas of a chunk: the same
    # (node-local dp, cp) position on the other nodes, `dp_inter_group` (built per cp rank).
    in_node = (topo.dp // topo.dp_nodes) * topo.cp
    if shard_group == "node":
        return ShardGroups(topo.dp_cp_intra_group, in_node, topo.dp_cp_intra_rank,
                           topo.dp_inter_group, topo.dp_nodes, topo.dp_inter_rank)
    return ShardGroups(topo.grad_group, topo.grad_size, topo.grad_rank,
                       secondary_group=topo.dp_cp_intra_group if hpz else None, secondary_size=in_node if hpz else 1,
                       secondary_rank=topo.dp_cp_intra_rank if hpz else 0, hpz=hpz,
                       quantized_gradients=quantized_gradients)
