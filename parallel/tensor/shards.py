"""How a parameter shard relates to its global tensor, and moving between the two.

`ShardSpec` is the one description of a tensor-parallel layout. `gather_full` rebuilds the global tensor from
the shards (an all-gather over the tp group) and `shard_of` cuts this rank's shard out of a global tensor
(checkpoint import, tests). Both honour `sections`, the per-head split of a fused QKV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazoo.parallel.collectives import all_gather_stacked


@dataclass(frozen=True)
class ShardSpec:
    """How this rank's tensor relates to the global tensor.

    `dim` None means replicated. Otherwise the global tensor's `dim` is `sections` equal blocks (3 for a fused
    QKV: [Q; K; V]) and each block is split evenly over `size` ranks; this rank holds its piece of every block,
    concatenated in block order. `sections` is how GPT-2's fused QKV is split by whole heads, not by row chunks.
    """

    global_shape: tuple[int, ...]
    dim: int | None = None
    sections: int = 1
    rank: int = 0
    size: int = 1

    def ranges(self) -> list[tuple[int, int]]:
        """Index ranges along `dim` of the global tensor that this rank holds, in local order."""
        assert self.dim is not None
        block = self.global_shape[self.dim] // self.sections
        piece = block // self.size
        return [(s * block + self.rank * piece, s * block + (self.rank + 1) * piece) for s in range(self.sections)]

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] //= self.size
        return tuple(shape)


def shard_of(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's shard of the global tensor `full` (a copy, contiguous)."""
    if tuple(full.shape) != spec.global_shape:
        raise ValueError(f"tensor of shape {tuple(full.shape)} does not match the layout's {spec.global_shape}")
    if spec.dim is None:
        return full.clone()
    return torch.cat([full.narrow(spec.dim, lo, hi - lo) for lo, hi in spec.ranges()], dim=spec.dim).contiguous()


def gather_full(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """The global tensor, on every rank of `group` (all-gather over tp; no communication when replicated)."""
    if spec.dim is None or spec.size == 1:
        return local.detach().clone()
    stacked = all_gather_stacked(local.detach(), group, spec.size)
    per_rank = [piece.chunk(spec.sections, dim=spec.dim) for piece in stacked.unbind(0)]
    return torch.cat([per_rank[r][s] for s in range(spec.sections) for r in range(spec.size)], dim=spec.dim)
