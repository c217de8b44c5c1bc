"""ZeRO-3's gather/free units (a block, or the root: every other parameter) and the materialising of a meta
model's parameters, one unit at a time (stage3.py builds them)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.zero.buckets import Bucket

Named = list[tuple[str, nn.Parameter, ShardSpec]]
InitFn = Callable[[nn.Module, str, torch.Tensor, ShardSpec], None]  # (owner module, global name, tensor, spec)


class Unit:
    """One gather/free unit: its buckets, this rank's chunk of each, and where its gathers stand."""

    def __init__(self, index: int, name: str, buckets: list[Bucket], frozen: list[Bucket] = ()):
        self.index, self.name, self.buckets = index, name, buckets
        self.shards = [b.flat_params[b.owned].clone() for b in buckets]
        # Frozen parameters (LoRA's base weights): partitioned and gathered like the rest, but no gradient, no
        # reduce-scatter, no master or optimizer state.
        self.frozen = list(frozen)
        self.frozen_shards = [b.flat_params[b.owned].clone() for b in self.frozen]
        self.params = [p for b in buckets for p in b.params]
        self.works: list = []
        self.gathered = True  # built full; freed right after construction
        self.grad_flats: list[torch.Tensor | None] = [None] * len(buckets)  # from the reducer's pool
        self.got: list[set[int]] = [set() for _ in buckets]  # offsets of the gradients copied into grad_flats
        self.storages = {b.flat_params.untyped_storage()._cdata for b in buckets + self.frozen}  # saved views
        self.secondary: list[torch.Tensor] | None = None  # hpZ: this rank's node-local part, forward to backward
        self.capture = False  # hpZ: the gather in flight is a primary one; keep the secondary when it is done
        self.ready = 0


def materialise(model: nn.Module, named: Named, init_fn: InitFn | None, device) -> Named:
    """Replace meta parameters by initialised real ones (the caller does this one unit at a time)."""
    owners = dict(model.named_modules())
    out = []
    for name, param, spec in named:
        if param.is_meta:
            if init_fn is None:
                raise ValueError(f"parameter {name} is on the meta device and no init_fn was given")
            owner_name, _, attr = name.rpartition(".")
            tensor = torch.empty(param.shape, dtype=param.dtype, device=device)
            init_fn(owners[owner_name], name, tensor, spec)
            param = nn.Parameter(tensor, requires_grad=param.requires_grad)
            setattr(owners[owner_name], attr, param)
        out.append((name, param, spec))
    return out
