"""`[fault_tolerance]`'s settings and their checks: plain data and arithmetic (no torch, no torchft), so
recipes/config.py, the resolver and `megazoo --help` load without either.

With `enabled = true` the recipe's `parallel.dp` ranks are cut into `replica_groups` groups of dp / replica_groups
ranks each (x tp x pp x cp). Each group is its own torch.distributed job (ZeRO 0-3 shards over the group's dp ranks:
HSDP's shard dimension; with zero.shard_group = "node" over each node of the group, a group of one node being one
HSDP replica); the groups are torchft replica groups, HSDP's replica dimension: the gradients are
averaged across the live groups through torchft's fault-tolerant process group after every step's quorum, a
group that fails is dropped and the others go on, and a restarted group heals from a live one
(parallel/fault_tolerance/replica.py). The lighthouse (torchft's quorum server) is started by `megazoo train`
unless `lighthouse` names one already running.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

LIGHTHOUSE_ADDRESS = re.compile(r"^https?://[^\s/:]+:\d{1,5}/?$")


@dataclass(frozen=True)
class FaultToleranceConfig:
    """`[fault_tolerance]`: off by default."""

    enabled: bool = False
    replica_groups: int = 2  # groups parallel.dp is cut into; each runs dp / replica_groups ranks (x tp x pp x cp)
    # "http://HOST:PORT" of a running torchft lighthouse; "" (the default): `megazoo train` starts one and names it
    lighthouse: str = ""
    min_replicas: int = 1  # a step commits only when at least this many groups took part in it
    max_group_restarts: int = 3  # per group: a failed group is started again this many times, then the job ends
    quorum_timeout_s: float = 60.0  # how long a group waits for the lighthouse's quorum of a step
    timeout_s: float = 30.0  # the cross-group all-reduce, the commit vote and a heal's state transfer
    join_timeout_s: float = 0.5  # lighthouse: how long a quorum waits for groups beyond the previous quorum's
    heartbeat_timeout_s: float = 5.0  # lighthouse: a group silent this long is out of the next quorum
    # At the start, groups wait up to this long for every group to join the first quorum (so a run without
    # failures computes what the same dp does without fault tolerance); after it, whoever is there starts
    start_timeout_s: float = 120.0
    # Stragglers: a rank whose step time exceeds `straggler_factor` x the median of its group's ranks for
    # `straggler_steps` steps in a row is named in the log (rank, host, its step time vs the median); 0: off
    straggler_factor: float = 0.0
    straggler_steps: int = 3


def check_fault_tolerance(ft: FaultToleranceConfig, *, dp: int, zero_stage: int, shard_group: str,
                          optimizer: str) -> None:
    """Raise ValueError naming the field, the value and what is valid, when `ft` cannot run this layout."""
    if ft.straggler_factor != 0 and not (math.isfinite(ft.straggler_factor) and ft.straggler_factor > 1):
        raise ValueError(f"fault_tolerance.straggler_factor = {ft.straggler_factor} is invalid; valid: 0 (off) or "
                         "a number > 1 (how many times the median step time makes a straggler)")
    if ft.straggler_steps < 1:
        raise ValueError(f"fault_tolerance.straggler_steps = {ft.straggler_steps} is invalid; valid: 1 or more")
    if not ft.enabled:
        return
    if ft.replica_groups < 2:
        raise ValueError(f"fault_tolerance.replica_groups = {ft.replica_groups} is invalid; valid: 2 or more "
                         "(one group has no peer to go on without it or to heal from)")
    if dp % ft.replica_groups:
        divisors = [g for g in range(2, dp + 1) if dp % g == 0]
        raise ValueError(f"fault_tolerance.replica_groups = {ft.replica_groups} does not divide parallel.dp = {dp}; "
                         f"valid: {', '.join(map(str, divisors)) or 'none: parallel.dp must be 2 or more'}")
    if not 1 <= ft.min_replicas <= ft.replica_groups:
        raise ValueError(f"fault_tolerance.min_replicas = {ft.min_replicas} is invalid; valid: 1 .. "
                         f"{ft.replica_groups} (fault_tolerance.replica_groups)")
    if ft.max_group_restarts < 0:
        raise ValueError(f"fault_tolerance.max_group_restarts = {ft.max_group_restarts} is invalid; valid: 0 or more")
    for name in ("quorum_timeout_s", "timeout_s", "join_timeout_s", "heartbeat_timeout_s", "start_timeout_s"):
        value = getattr(ft, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"fault_tolerance.{name} = {value} is invalid; valid: a number of seconds > 0")
    if ft.lighthouse and not LIGHTHOUSE_ADDRESS.match(ft.lighthouse):
        raise ValueError(f"fault_tolerance.lighthouse = {ft.lighthouse!r} is invalid; valid: \"http://HOST:PORT\" of "
                         "a running torchft lighthouse, or \"\" (megazoo train starts one)")
    if optimizer != "adamw":
        raise ValueError(f"fault_tolerance with optimizer.name = {optimizer!r} is invalid; valid: \"adamw\" (the "
                         "compressed optimizers run their own data-parallel exchange, outside torchft's quorum)")


DILOCO_COMPRESSION = ("none", "onebit", "int8")


@dataclass(frozen=True)
class DiLoCoConfig:
    """`[diloco]` (parallel/fault_tolerance/diloco.py): each node's dp ranks are one group training alone for
    `inner_steps` steps (the recipe's AdamW and ZeRO stage 0-2 inside the node), then one outer step across the nodes:
    the groups' average of (parameters at the last sync - parameters now) is the outer gradient of an SGD step
    with Nesterov momentum from the last sync's parameters, and every group continues from the result."""

    enabled: bool = False
    inner_steps: int = 8  # H: optimizer steps inside a group between two outer steps
    outer_lr: float = 0.7  # the outer SGD's learning rate (DiLoCo, Douillard et al. 2023: 0.7)
    outer_momentum: float = 0.9  # the outer SGD's momentum; 0: none
    nesterov: bool = True  # Nesterov momentum (the paper's outer optimizer); false: heavy-ball
    # The outer gradients on the wire: "none" (fp32 all-reduce), "onebit" (1-bit Adam's sign compression with
    # worker and server error feedback, parallel/compressed/comms.py) or "int8" (qwZ's int8 blocks with error
    # feedback, parallel/zero/quantized.py)
    compression: str = "none"


def diloco_groups(node_size: int, dp: int, tp: int, cp: int) -> int:
    """How many DiLoCo groups (nodes of dp ranks) the layout has: dp / the dp ranks one node holds."""
    return dp // max(1, min(node_size // (tp * cp), dp))


def check_diloco(d: DiLoCoConfig, *, dp: int, tp: int, cp: int, ep: int, node_size: int, zero_stage: int,
                 shard_group: str, offload: str, quantized_gradients: str, optimizer: str, ft_enabled: bool) -> None:
    """Raise ValueError naming the field, the value and what is valid, when `d` cannot run this layout."""
    if d.inner_steps < 1:
        raise ValueError(f"diloco.inner_steps = {d.inner_steps} is invalid; valid: an integer >= 1 (optimizer steps "
                         "inside a group between outer steps)")
    if not (math.isfinite(d.outer_lr) and d.outer_lr > 0):
        raise ValueError(f"diloco.outer_lr = {d.outer_lr} is invalid; valid: a number > 0")
    if not (math.isfinite(d.outer_momentum) and 0 <= d.outer_momentum < 1):
        raise ValueError(f"diloco.outer_momentum = {d.outer_momentum} is invalid; valid: 0 <= momentum < 1")
    if d.compression not in DILOCO_COMPRESSION:
        raise ValueError(f"diloco.compression = {d.compression!r} is invalid; valid: "
                         f"{', '.join(map(repr, DILOCO_COMPRESSION))}")
    if not d.enabled:
        return
    if node_size < 1:
        raise ValueError(f"diloco with parallel.node_size = {node_size} is invalid; valid: the processes per node "
                         "(> 0): DiLoCo's groups are the nodes, so their size must be known before the start")
    groups = diloco_groups(node_size, dp, tp, cp)
    if groups < 2:
        raise ValueError(f"diloco with parallel.node_size = {node_size} puts all of parallel.dp = {dp} on one node "
                         f"(1 group); valid: a node size whose node_size / (tp x cp = {tp * cp}) is a proper divisor "
                         f"of dp = {dp} (2 or more groups to average)")
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"diloco with zero.stage = {zero_stage} is not supported; valid: 0, 1, 2 (the outer step runs "
                         "on each rank's owned fp32 master chunk inside its node)")
    if zero_stage and shard_group != "node":
        raise ValueError(f"diloco with zero.shard_group = {shard_group!r} is invalid; valid: \"node\" (each node is "
                         "one group: ZeRO shards inside it, only the outer step crosses nodes)")
    for field_name, value, valid in (("zero.offload", offload, "none"),
                                     ("zero.quantized_gradients", quantized_gradients, "none"),
                                     ("optimizer.name", optimizer, "adamw")):
        if value != valid:
            raise ValueError(f"diloco with {field_name} = {value!r} is not supported; valid: {valid!r}")
    if ep > 1:
        raise ValueError(f"diloco with parallel.ep = {ep} is not supported; valid: 1")
    if ft_enabled:
        raise ValueError("diloco with fault_tolerance.enabled = true is not supported; valid: one of them (DiLoCo's "
                         "groups are the nodes of one job, not torchft replica groups)")
