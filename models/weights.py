"""Initialising a GPT's shards and reading back its full (unsharded) weights.

Initial values depend only on (seed, global parameter name, global shape): see parallel/tensor/init.py. So the
same seed gives the same full model for every tp (and every later dp/pp/ZeRO layout), and each rank generates
only its own shard.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megazoo.models.layout import VOCAB_PARAMETERS
from megazoo.models.moe.dispatch import expert_parameter_names
from megazoo.models.norms import RMSNorm
from megazoo.models.transformer import GPT
from megazoo.parallel.tensor import ShardSpec, VocabParallelEmbedding, named_shards, normal_shard_
from megazoo.parallel.tensor.shards import full_state_dict as tp_full_state_dict


@torch.no_grad()
def init_parameter_(model: GPT, module: nn.Module, name: str, param: torch.Tensor, spec: ShardSpec,
                    seed: int) -> None:
    """GPT-2 initialisation of one parameter shard, by its global `name`: N(0, 0.02) weights,
    0.02/sqrt(2L) for residual projections, zero biases, LoRA's A ~ N(0, 1/r) and B = 0, unit LayerNorm / RMSNorm, zero padded vocabulary rows
    (of the embedding and of an untied head)."""
    if isinstance(module, (nn.LayerNorm, RMSNorm)):
        param.fill_(1.0 if name.endswith("weight") else 0.0)
    elif name.endswith(("bias", "lora_B")):  # LoRA's B starts at zero: the adapter adds nothing at first
        param.zero_()
    else:
        std = getattr(module, "init_std", model.cfg.init_std)
        normal_shard_(param, spec, std=std, seed=seed, name=name)
    if isinstance(module, VocabParallelEmbedding):
        # Padding ids are never inputs and their logits are masked: zero rows keep them inert.
        first_pad = model.cfg.vocab_size - module.vocab_start
        if first_pad < param.shape[0]:
            param[max(first_pad, 0):].zero_()
    elif name == "lm_head.weight":  # column-parallel: this rank's rows of the padded vocabulary
        first_pad = model.cfg.vocab_size - spec.ranges()[0][0] if spec.dim is not None else model.cfg.vocab_size
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
    """Every parameter of this rank's stage as a full tensor (all-gathered over tp), the embedding without its
    padding rows. Under ZeRO-3 call it inside `zero.gathered()`."""
    experts = {}  # expert parallelism: the routed experts are split over the ep group, not tp
    if model.topo.ep > 1:
        experts = dict.fromkeys(expert_parameter_names(model), model.topo.ep_group)
    full = tp_full_state_dict(model, model.topo.tp_group, experts)
    for name in VOCAB_PARAMETERS:
        if name in full:
            full[name] = full[name][: model.cfg.vocab_size]
    return full


def count_parameters(model: nn.Module, unpadded_vocab: int | None = None) -> int:
    """Number of parameters of this rank's shard (meta-device models too); with `unpadded_vocab`, the padded
    vocabulary rows of the embedding (and of an untied head) are left out of the count."""
    total = sum(p.numel() for p in model.parameters())
    if unpadded_vocab is not None and hasattr(model, "wte"):
        wte = model.wte
        pad_rows = max(0, wte.vocab_end - max(unpadded_vocab, wte.vocab_start))
        total -= pad_rows * wte.embedding_dim
    if unpadded_vocab is not None and hasattr(model, "lm_head"):
        start, end = model.lm_head.shard_specs["weight"].ranges()[0]
        total -= max(0, end - max(unpadded_vocab, start)) * model.lm_head.in_features
    return total
