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


def shard_spec(module: torch.nn.Module, param_name: str, param: torch.Tensor) -> ShardSpec:
    """The layout of one parameter: tensor-parallel layers declare theirs in `shard_specs`; parameters of plain
    torch modules are replicated."""
    return getattr(module, "shard_specs", {}).get(param_name) or ShardSpec(tuple(param.shape))


def named_shards(model: torch.nn.Module):
    """Yield (global name, parameter, ShardSpec) for every parameter, in registration order (a tied parameter
    once per name that holds it)."""
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            yield name, param, shard_spec(module, param_name, param)


def unique_named_shards(model: torch.nn.Module):
    """(unique, aliases): `named_shards` with each parameter once, under its first name, plus the other names
    of shared (tied) parameters as {alias: first name}. Hugging Face GPT-2 yields wte.weight twice
    (as transformer.wte.weight and lm_head.weight); an optimizer must see it once."""
    seen: dict[int, str] = {}
    unique, aliases = [], {}
    for name, param, spec in named_shards(model):
        if id(param) in seen:
            aliases[name] = seen[id(param)]
        else:
            seen[id(param)] = name
            unique.append((name, param, spec))
    return unique, aliases


@torch.no_grad()
def full_state_dict(model: torch.nn.Module, group, groups: dict | None = None) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every tensor-parallel parameter all-gathered over `group` (tp): tied names and
    buffers included, so it loads into a single-process copy with `load_state_dict`. Under ZeRO-3 call it
    inside `zero.gathered()`. `groups`: the parameters split over another group (name -> group: the routed
    experts over ep). Collective: one all-gather over tp per tp-sharded parameter."""
    specs = {name: spec for name, _, spec in named_shards(model)}
    groups = groups or {}
    return {key: gather_full(value, specs[key], groups.get(key, group)) if key in specs else value.detach().clone()
            for key, value in model.state_dict(keep_vars=True).items()}
