"""`[lora]`'s settings, their checks, where each target sits and how many adapter elements it adds: plain data and
arithmetic (no torch), so recipes/config.py, the resolver and the planner load, and `megazoo --help` answers,
without importing torch. models/lora/adapters.py (attaching, freezing, merging the adapters) re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazoo.models.config import ModelConfig
from megazoo.models.layout import kv_split

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
    attention_targets = [t for t in lora.targets if t in ("qkv", "q", "k", "v", "o")]
    if cfg.mla and attention_targets:  # models/deepseek/mla.py's projections take no adapters yet
        raise ValueError(f"lora.targets {attention_targets} on model {cfg.name}, which has latent attention "
                         f"(model.kv_lora_rank = {cfg.kv_lora_rank}): LoRA on it is not supported yet; valid targets: "
                         f"{[t for t in valid if t not in attention_targets]} (dense MLP layers only)")
    mlp_targets = [t for t in lora.targets if t in ("gate", "up", "down")]
    if cfg.n_experts and mlp_targets:  # the MoE layers' MLP is the stacked experts, which take no adapters
        raise ValueError(f"lora.targets {mlp_targets} on model {cfg.name}, which has {cfg.n_experts} experts: LoRA on "
                         f"the experts is not supported; valid targets: {[t for t in valid if t not in mlp_targets]}")
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
