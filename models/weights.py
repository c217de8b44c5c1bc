"""Initialising a GPT's shards and reading back its full (unsharded) weights.

Initial values depend only on (seed, global parameter name, global shape): see parallel/tensor/init.py. So the
same seed gives the same full model for every tp (and every later dp/pp/ZeRO layout), and each rank generates
only its own shard.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megazoo.models.transformer import GPT
from megazoo.parallel.tensor import ShardSpec, VocabParallelEmbedding, gather_full, normal_shard_


def shard_spec(module: nn.Module, param_name: str, param: torch.Tensor) -> ShardSpec:
    """The layout of one parameter; parameters of plain torch modules are replicated."""
    return getattr(module, "shard_specs", {}).get(param_name) or ShardSpec(tuple(param.shape))


def named_shards(model: nn.Module):
    """Yield (global name, parameter, ShardSpec) for every parameter, in registration order."""
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            yield name, param, shard_spec(module, param_name, param)


@torch.no_grad()
def init_parameter_(model: GPT, module: nn.Module, name: str, param: torch.Tensor, spec: ShardSpec,
                    seed: int) -> None:
    """GPT-2 initialisation of one parameter shard, by its global `name`: N(0, 0.02) weights,
    0.02/sqrt(2L) for residual projections, zero biases, unit LayerNorm, zero padded vocabulary rows."""
    if isinstance(module, nn.LayerNorm):
        param.fill_(1.0 if name.endswith("weight") else 0.0)
    elif name.endswith("bias"):
        param.zero_()
    else:
        std = getattr(module, "init_std", model.cfg.init_std)
        normal_shard_(param, spec, std=std, seed=seed, name=name)
    if isinstance(module, VocabParallelEmbedding):
        # Padding ids are never inputs and their logits are masked: zero rows keep them inert.
        first_pad = model.cfg.vocab_size - module.vocab_start
        if first_pad < param.shape[0]:
            param[max(first_pad, 0):].zero_()


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """Initialise every parameter shard of `model` (built on a real device) from `seed`."""
    owners = dict(model.named_modules())
    for name, param, spec in named_shards(model):
        if param.is_meta:
            raise ValueError("cannot initialise a model on the meta device: build it on a real device")
        init_parameter_(model, owners[name.rpartition(".")[0]], name, param.data, spec, seed)


def full_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's stage as a full tensor (all-gathered over tp), embedding unpadded."""
    group = model.topo.tp_group
    full = {name: gather_full(param, spec, group) for name, param, spec in named_shards(model)}
    if "wte.weight" in full:
        full["wte.weight"] = full["wte.weight"][: model.cfg.vocab_size]
    return full


def count_parameters(model: nn.Module, unpadded_vocab: int | None = None) -> int:
    """Number of parameters of this rank's shard (meta-device models too); with `unpadded_vocab`, the padded
    vocabulary rows of the embedding are left out of the count."""
    total = sum(p.numel() for p in model.parameters())
    if unpadded_vocab is not None and hasattr(model, "wte"):
        wte = model.wte
        pad_rows = max(0, wte.vocab_end - max(unpadded_vocab, wte.vocab_start))
        total -= pad_rows * wte.embedding_dim
    return total
