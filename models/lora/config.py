"""`[lora]`'s settings, their checks, where each target sits and how many adapter elements it adds: plain data and
arithmetic (no torch), so recipes/config.py, the resolver and the planner load, and `megazoo --help` answers,
without importing torch. models/lora/adapters.py (attaching, freezing, merging the adapters) re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazoo.models.config import ModelConfig
from megazoo.models.layout import kv_split

TARGETS = ("qkv", "q", "k", "v", "kv", "o", "gate", "up", "down")  # kv: latent attention's kv_b only


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
    """Latent attention (models/deepseek/mla.py) takes adapters on its tp-split projections: q (q_b, or c_q without
    q compression), kv (kv_b: every head's [k_nope; v] from the latent) and o; its replicated down-projections
    (q_a, kv_a) take none."""
    gated = ("gate",) if cfg.mlp == "swiglu" else ()
    if cfg.mla:
        return ("q", "kv", "o") + gated + ("up", "down")
    fused = ("qkv",) if cfg.fused_qkv else ()
    return fused + ("q", "k", "v", "o") + gated + ("up", "down")


def _placement(cfg: ModelConfig, target: str) -> tuple[str, tuple[int, ...]]:
    """(layer path inside a block, sections the adapter covers) of a target."""
    if cfg.mla and target in ("q", "kv"):
        return ("attn.q_b" if cfg.q_lora_rank else "attn.c_q", (0,)) if target == "q" else ("attn.kv_b", (0,))
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
    inputs = {"attn.c_proj": cfg.n_head * hd, "mlp.c_proj": cfg.d_ff}
    if cfg.mla:  # (models/deepseek/mla.py) q: (nope + rope) per head, kv_b: the latent -> (nope + v) per head
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        rows.update({"attn.c_q": cfg.n_head * qk, "attn.q_b": cfg.n_head * qk,
                     "attn.kv_b": cfg.n_head * (cfg.qk_nope_head_dim + cfg.v_head_dim)})
        inputs.update({"attn.c_proj": cfg.n_head * cfg.v_head_dim, "attn.q_b": cfg.q_lora_rank,
                       "attn.kv_b": cfg.kv_lora_rank})
    total = 0
    for path, covers in adapter_layers(cfg, lora).values():
        if path in ("attn.c_proj", "mlp.c_proj"):  # row-parallel: A split, B replicated
            total += r * inputs[path] // tp + d * r
        else:
            total += r * inputs.get(path, d) + len(covers) * rows[path] * r // tp
    return total
