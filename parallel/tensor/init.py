"""Deterministic, layout-independent initialisation of parameter shards.

A parameter's initial values are a function of (seed, its global name, its global shape) only, never of the
tensor-parallel layout: the global tensor, viewed as rows x columns, is cut into fixed tiles of rows whose random
numbers come from a generator seeded by (seed, name, tile index). A rank generates only the tiles that intersect
its shard, one tile at a time, so no rank ever materialises a whole large parameter, and tp=1, 2, 4, ... produce
bit-identical full weights.
"""

from __future__ import annotations

import hashlib
import math

import torch

from megazoo.parallel.simulation.fake_world import has_values
from megazoo.parallel.tensor.shards import ShardSpec

TILE_ELEMENTS = 1 << 20  # ~4 MB of fp32 per generated tile


def _tile_seed(seed: int, name: str, tile: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{name}|{tile}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def normal_shard_(local: torch.Tensor, spec: ShardSpec, *, std: float, seed: int, name: str) -> torch.Tensor:
    """Fill `local` with this rank's part of a N(0, std^2) global tensor named `name`."""
    if not has_values(local):  # a dry run's fake shard: nothing to fill (a 17B model's tiles cost ~40 s there)
        return local
    shape = spec.global_shape
    rows, cols = shape[0], math.prod(shape[1:])
    if spec.dim not in (None, 0) and len(shape) != 2:
        raise ValueError(f"{name}: only dim 0 or the columns of a 2-D tensor can be sharded, got {spec}")
    row_ranges = spec.ranges() if spec.dim == 0 else [(0, rows)]
    col_lo, col_hi = (spec.ranges()[0] if spec.dim == 1 else (0, cols))
    assert spec.dim != 1 or spec.sections == 1, "column sharding with sections is not used"
    rows_per_tile = max(1, TILE_ELEMENTS // cols)
    out = local.view(-1, col_hi - col_lo)
    dst = 0
    for lo, hi in row_ranges:
        for tile in range(lo // rows_per_tile, (hi - 1) // rows_per_tile + 1):
            t_lo = tile * rows_per_tile
            t_rows = min(rows_per_tile, rows - t_lo)
            gen = torch.Generator().manual_seed(_tile_seed(seed, name, tile))
            values = torch.randn(t_rows, cols, generator=gen)
            a, b = max(lo, t_lo), min(hi, t_lo + t_rows)
            part = values[a - t_lo:b - t_lo, col_lo:col_hi].mul_(std)
            out[dst:dst + (b - a)].copy_(part)
            dst += b - a
    return local
