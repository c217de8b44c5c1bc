"""Checkpoint views of the frozen parameters (LoRA's base weights), which no optimizer state view covers.

The stages' state_views() cover what they train. A LoRA run's checkpoints therefore hold only the adapters (and
their Adam moments): the frozen base is read from the checkpoint it started from, through these views. Stages
0-2 hold every frozen parameter whole on each rank; ZeRO-3 holds this rank's chunk of its units' frozen buckets
(parallel/zero/stage3.py), which the next gather spreads (call the stage's after_load() after filling them).
"""

from __future__ import annotations

import torch

from megazoo.parallel.checkpoint.views import StateView
from megazoo.parallel.tensor import ShardSpec


def frozen_views(zero, named: list[tuple[str, torch.nn.Parameter, ShardSpec]], write: bool) -> list[StateView]:
    """"param" views of every frozen parameter this rank holds (`named`: the model's unique named shards)."""
    units = getattr(zero, "units", None)
    if units is None:
        return [StateView(name, spec, "param", 0, p.numel(), p.detach().view(-1), write)
                for name, p, spec in named if not p.requires_grad]
    specs = {name: spec for name, _, spec in named}
    views = []
    for unit in units:
        for bucket, shard in zip(unit.frozen, unit.frozen_shards):
            start, stop = bucket.owned.start, bucket.owned.stop
            for name, p, off in zip(bucket.names, bucket.params, bucket.offsets):
                lo, hi = max(off, start), min(off + p.numel(), stop)
                if lo < hi:
                    views.append(StateView(name, specs[name], "param", lo - off, hi - off, shard[lo - start:hi - start]))
    return views


@torch.no_grad()
def fill_views(views: list[StateView], full_state: dict[str, torch.Tensor], kinds: tuple[str, ...]) -> list[str]:
    """Copy this rank's part of each full tensor into the views of `kinds` that name it; returns the names filled."""
    from megazoo.parallel.tensor import shard_of

    filled = []
    for view in views:
        if view.kind in kinds and view.name in full_state:
            local = shard_of(full_state[view.name].to(view.tensor.dtype), view.spec).view(-1)
            view.tensor.copy_(local[view.start:view.stop])
            filled.append(view.name)
    return filled
