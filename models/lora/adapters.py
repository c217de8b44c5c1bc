"""LoRA on a megazoo GPT: which projections get adapters (`[lora]`), attaching them, freezing the base, merging.

Targets name the projections the way fine-tuning recipes do; each maps onto one of our (possibly fused) layers and
the sections of it the adapter covers (parallel/tensor/lora.py holds the adapters and their tp split):

    target  GPT-2 style (fused c_attn)            grouped-query / Llama style
    qkv     attn.c_attn, one adapter, all three    (only where q, k, v are fused: n_kv_head = n_head)
    q/k/v   attn.c_attn section 0 / 1 / 2          attn.c_q / attn.c_kv section 0 (k) / 1 (v)
    o       attn.c_proj (row-parallel)             attn.c_proj
    gate    -                                      mlp.c_fc section 0 ([gate; up])
    up      mlp.c_fc                               mlp.c_fc section 1
    down    mlp.c_proj (row-parallel)              mlp.c_proj

So PEFT's LoRA on HF GPT-2's `c_attn` is target "qkv", and on HF Llama's `q_proj` / `v_proj` targets "q" / "v".
An adapter's parameters are `<layer>.lora.<target>.lora_A` / `lora_B` (A: (r, in), B: (out, r), full shapes).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megazoo.models.config import ModelConfig
# the torch-free half (settings, checks, target placement, the planner's count), re-exported under these names
from megazoo.models.lora.config import (TARGETS, LoRAConfig, adapter_layers, adapter_parameters,  # noqa: F401
                                        check_lora, valid_targets)
from megazoo.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from megazoo.parallel.tensor.lora import ColumnLoRA, RowLoRA, is_lora_parameter

def attach_lora(model: nn.Module, lora: LoRAConfig) -> None:
    """Give every block of `model` (a GPT or a pipeline stage of one) its adapters, then freeze everything else.
    Adapters are allocated like the layer they sit on (device, dtype, meta included); initialise them with
    models/weights.py's init_weights (A ~ N(0, 1/r), B = 0) or load them."""
    cfg, topo = model.cfg, model.topo
    check_lora(lora, cfg, topo.tp)
    for block in model.h.values():
        for target, (path, covers) in adapter_layers(cfg, lora).items():
            layer = block.get_submodule(path)
            kw = dict(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, device=layer.weight.device,
                      dtype=layer.weight.dtype)
            if isinstance(layer, ColumnParallelLinear):
                adapter = ColumnLoRA(layer.in_features, layer.out_features // layer.sections, covers, layer.group,
                                     **kw)
            elif isinstance(layer, RowParallelLinear):
                adapter = RowLoRA(layer.in_features, layer.out_features, layer.group, rng=model.rng, **kw)
            else:
                raise ValueError(f"lora target {target!r}: {path} is a {type(layer).__name__}, not a tp linear")
            if layer.lora is None:
                layer.lora = nn.ModuleDict()
            layer.lora[target] = adapter
    freeze_base(model)


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train: every other parameter gets requires_grad = False (no gradient, no optimizer
    state: the ZeRO stages bucket and partition trainable parameters only)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_parameter(name))


@torch.no_grad()
def merge_lora(full_state: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """A full state (models/weights.py full_state_dict of a LoRA model) with every adapter folded into its base
    weight, W += (alpha / r) B A over the sections it covers, and the adapters' tensors dropped."""
    return {name: merged_weight(name, t, full_state, cfg, lora) for name, t in full_state.items()
            if not is_lora_parameter(name)}


def merged_weight(name: str, weight: torch.Tensor, adapters, cfg: ModelConfig, lora: LoRAConfig,
                  in_place: bool = False) -> torch.Tensor:
    """The base tensor `name` with the adapters that sit on it (looked up in `adapters`, a mapping holding at least
    every lora_A / lora_B) folded in; a tensor no adapter covers is returned as it is. One tensor at a time, so a
    merge streams (models/hf/convert_lora.py); `in_place`: `weight` is a fresh copy the caller gives up (no clone)."""
    parts = name.split(".", 2)
    if len(parts) < 3 or parts[0] != "h" or not parts[2].endswith(".weight"):
        return weight
    path = parts[2].removesuffix(".weight")
    prefix = f"h.{parts[1]}.{path}"
    targets = [(target, covers) for target, (p, covers) in adapter_layers(cfg, lora).items() if p == path]
    if not targets:
        return weight
    weight = weight if in_place else weight.clone()
    for target, covers in targets:
        a, b = adapters.get(f"{prefix}.lora.{target}.lora_A"), adapters.get(f"{prefix}.lora.{target}.lora_B")
        if a is None or b is None:
            raise ValueError(f"merge_lora: the state lacks {prefix}.lora.{target}.lora_A / lora_B")
        wide = b.double() @ a.double()  # (covered out, in), in fp64; one temporary at a time (a merge streams)
        delta = wide.mul_(lora.scaling).to(weight.dtype)
        del wide
        if not covers:  # row-parallel: the whole weight
            weight += delta
        else:
            per = delta.shape[0] // len(covers)  # rows of one section
            for k, s in enumerate(covers):
                weight[s * per:(s + 1) * per] += delta[k * per:(k + 1) * per]
    return weight
