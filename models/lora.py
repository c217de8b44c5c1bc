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

from dataclasses import dataclass

import torch
import torch.nn as nn

from megazoo.models.config import ModelConfig
from megazoo.models.layout import kv_split
from megazoo.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from megazoo.parallel.tensor.lora import ColumnLoRA, RowLoRA, is_lora_parameter

TARGETS = ("qkv", "q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class LoRAConfig:
    """`[lora]`: rank 0 (the default) is off: full fine-tuning. alpha / rank scales the adapters' output."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")
    # A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start the adapters from, instead of
    # A ~ N(0, 1/r), B = 0; its r, lora_alpha and target modules must match the keys above. The base weights come
    # from checkpoint.load (recipes/training/lora_setup.py).
    adapter: str = ""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def check_lora(lora: LoRAConfig, cfg: ModelConfig, tp: int = 1) -> None:
    """Raise ValueError naming the field, the value and what is valid, when `lora` cannot apply to `cfg` at tp."""
    if lora.rank < 0:
        raise ValueError(f"lora.rank = {lora.rank} is invalid; valid: 0 (off) or a positive integer")
    if not lora.enabled:
        return
    if not 0.0 <= lora.dropout < 1.0:
        raise ValueError(f"lora.dropout = {lora.dropout} is invalid; valid: 0 <= dropout < 1")
    if lora.alpha <= 0:
        raise ValueError(f"lora.alpha = {lora.alpha} is invalid; valid: a positive number")
    valid = valid_targets(cfg)
    bad = [t for t in lora.targets if t not in valid]
    if bad or not lora.targets or len(set(lora.targets)) != len(lora.targets):
        raise ValueError(f"lora.targets = {list(lora.targets)} is invalid for model {cfg.name}: give each at most once"
                         f", from {list(valid)}")
    if "qkv" in lora.targets and {"q", "k", "v"} & set(lora.targets):
        raise ValueError(f"lora.targets = {list(lora.targets)}: 'qkv' already covers q, k and v; give 'qkv' or "
                         "some of q, k, v")
    if {"k", "v"} & set(lora.targets) and not cfg.fused_qkv and not kv_split(cfg, tp):
        raise ValueError(f"lora.targets k/v with parallel.tp = {tp} > model.n_kv_head = {cfg.n_kv_head} "
                         "(replicated key/value heads) is not supported; valid: tp dividing n_kv_head, or targets "
                         "without k and v")


def valid_targets(cfg: ModelConfig) -> tuple[str, ...]:
    gated = ("gate",) if cfg.mlp == "swiglu" else ()
    fused = ("qkv",) if cfg.fused_qkv else ()
    return fused + ("q", "k", "v", "o") + gated + ("up", "down")


def _placement(cfg: ModelConfig, target: str) -> tuple[str, tuple[int, ...]]:
    """(layer path inside a block, sections the adapter covers) of a target."""
    if target == "qkv":
        return "attn.c_attn", (0, 1, 2)
    if target in ("q", "k", "v"):
        if cfg.fused_qkv:
            return "attn.c_attn", (("q", "k", "v").index(target),)
        return ("attn.c_q", (0,)) if target == "q" else ("attn.c_kv", (("k", "v").index(target),))
    if target == "o":
        return "attn.c_proj", ()
    if target == "down":
        return "mlp.c_proj", ()
    swiglu = cfg.mlp == "swiglu"
    return "mlp.c_fc", ((0,) if target == "gate" else (1,) if swiglu else (0,))


def adapter_layers(cfg: ModelConfig, lora: LoRAConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{target: (layer path inside a block, covered sections)} of the recipe's targets."""
    return {t: _placement(cfg, t) for t in lora.targets}


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
    merged = {name: t for name, t in full_state.items() if not is_lora_parameter(name)}
    for i in range(cfg.n_layer):
        for target, (path, covers) in adapter_layers(cfg, lora).items():
            prefix = f"h.{i}.{path}"
            a, b = full_state.get(f"{prefix}.lora.{target}.lora_A"), full_state.get(f"{prefix}.lora.{target}.lora_B")
            if a is None or b is None:
                raise ValueError(f"merge_lora: the state lacks {prefix}.lora.{target}.lora_A / lora_B")
            weight = merged[f"{prefix}.weight"].clone()
            delta = (b.double() @ a.double() * lora.scaling).to(weight.dtype)  # (covered out, in)
            if not covers:  # row-parallel: the whole weight
                weight += delta
            else:
                per = delta.shape[0] // len(covers)  # rows of one section
                for k, s in enumerate(covers):
                    weight[s * per:(s + 1) * per] += delta[k * per:(k + 1) * per]
            merged[f"{prefix}.weight"] = weight
    return merged


def adapter_parameters(cfg: ModelConfig, lora: LoRAConfig, tp: int = 1) -> int:
    """Adapter elements one block holds on one tp rank (pure arithmetic, for the planner): a column-parallel
    layer's A is replicated and its B split; a row-parallel layer's A split and its B replicated."""
    if not lora.enabled:
        return 0
    d, hd, r = cfg.d_model, cfg.head_dim, lora.rank
    rows = {"attn.c_attn": d, "attn.c_q": cfg.n_head * hd, "attn.c_kv": cfg.n_kv_head * hd, "mlp.c_fc": cfg.d_ff}
    total = 0
    for path, covers in adapter_layers(cfg, lora).values():
        if path == "attn.c_proj":
            total += r * cfg.n_head * hd // tp + d * r
        elif path == "mlp.c_proj":
            total += r * cfg.d_ff // tp + d * r
        else:
            total += r * d + len(covers) * rows[path] * r // tp
    return total
