"""One constructor for every ZeRO stage, so training loops (ours and users') hold one object.

Every returned object implements `ZeroOptimizer` (interface.py); `optimizer_step` there drives all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Sequence

import torch
import torch.nn as nn

from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.buckets import DEFAULT_BUCKET_ELEMENTS
from megazoo.parallel.zero.groups import check_shard_choice, shard_groups
from megazoo.parallel.zero.partitioned import TiedParameters
from megazoo.parallel.zero.stage0 import DataParallelAdamW
from megazoo.parallel.zero.stage3 import InitFn, ZeroStage3
from megazoo.parallel.zero.stage12 import ZeroStage12


def build_zero(stage: int, model: nn.Module, named: list[tuple[str, nn.Parameter, ShardSpec]], topo: Topology, *,
               lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
               bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, offload: str = "none",
               units: Sequence[nn.Module] = (), init_fn: InitFn | None = None,
               tied: TiedParameters = TiedParameters(), group_of: Callable[[str], Hashable] | None = None,
               adamw: Callable | None = None, compression=None, shard_group: str = "dp", hpz: bool = False,
               quantized_weights: bool = False, quantized_gradients: str = "none", replica_reduce: bool = True,
               fp8_all_gather: bool = False):
    """The data-parallel optimizer for ZeRO `stage` (0-3). Stage 3 needs `units` (the submodules gathered one at
    a time, e.g. the transformer blocks) and, for a model built on the meta device, `init_fn`. `tied` names
    parameters held by two pipeline stages; `group_of(name)` keeps groups (pipeline chunks) in separate buckets.
    `adamw(groups, lr=, betas=, eps=)` builds the optimizer over what the rank owns (the caller passes the
    kernels' adamw op); default: torch's single-tensor loop, torch.optim.AdamW(foreach=False).
    `compression` (parallel/compressed/schedule.py CompressionSettings): 1-bit / 0-1 Adam, stage 0 or 1.
    `shard_group` "node" (HSDP) and `hpz` (stage 3): the node-aware partitions of groups.py; `quantized_weights`
    (stage 3): qwZ, the gathers in int8 blocks (quantized.py); `quantized_gradients` "int8" | "int4" (stages
    1-3): qgZ, the hierarchical quantized gradient reduce (qgz.py). `replica_reduce=False` (stage 0, or HSDP): the
    gradients are averaged inside the node only (DiLoCo, parallel/fault_tolerance/diloco.py, crosses nodes in its
    outer step instead); the other nodes' ranks still never write the owned states of a checkpoint. `fp8_all_gather`
    (stage 3, FP8 tensorwise linears): their weights gathered as float8 (gather/fp8.py)."""
    adamw = adamw or _torch_adamw
    if fp8_all_gather and stage != 3:
        raise ValueError(f"zero.fp8_all_gather = true needs zero.stage = 3 (got {stage}): only stage 3 gathers "
                         "weights for compute")
    check_shard_choice(shard_group, hpz, stage, topo.cp, quantized_weights, quantized_gradients, offload)
    if compression is not None and quantized_gradients != "none":
        raise ValueError(f"zero.quantized_gradients = {quantized_gradients!r} with optimizer {compression.name!r} "
                         "is not supported (it compresses its own gradient exchange); valid: 'none'")
    groups = shard_groups(topo, shard_group, hpz, stage, quantized_gradients) if stage else None
    if groups is not None and not replica_reduce:
        groups = dataclasses.replace(groups, replica_group=None, replica_size=1)
    if compression is not None:
        from megazoo.parallel.compressed.optimizer import CompressedAdam  # imports stage0: not at module level
        from megazoo.parallel.compressed.zero1 import CompressedAdamZero1
        if stage not in (0, 1) or offload != "none":
            raise ValueError(f"optimizer {compression.name!r} needs zero.stage = 0 or 1 without offload (got stage "
                             f"{stage}, offload {offload!r})")
        return (CompressedAdam if stage == 0 else CompressedAdamZero1)(named, topo, settings=compression, lr=lr, betas=betas, eps=eps,
                              weight_decay=weight_decay, tied=tied, adamw=adamw, bucket_elements=bucket_elements)
    if stage == 0:
        if offload != "none":
            raise ValueError("zero.offload = 'cpu' needs zero.stage >= 1 (the optimizer states must be partitioned)")
        return DataParallelAdamW(named, topo, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, tied=tied,
                                 adamw=adamw, bucket_elements=bucket_elements, node_only=not replica_reduce)
    if stage in (1, 2):
        return ZeroStage12(named, topo, stage=stage, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                           bucket_elements=bucket_elements, offload=offload, tied=tied, group_of=group_of,
                           adamw=adamw, model=model, groups=groups, units=units)
    if stage == 3:
        if topo.pp > 1:
            raise ValueError("zero.stage = 3 with parallel.pp > 1 is not supported; valid: zero.stage 0-2 with pp")
        return ZeroStage3(model, named, list(units), topo, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                          init_fn=init_fn, offload=offload, adamw=adamw, groups=groups,
                          quantized_weights=quantized_weights, fp8_all_gather=fp8_all_gather)
    raise ValueError(f"zero.stage = {stage} is invalid; valid: 0, 1, 2, 3")


def _torch_adamw(groups, *, lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
