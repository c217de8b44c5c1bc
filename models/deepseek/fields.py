"""The checks of multi-head latent attention's and YaRN's ModelConfig fields (models/config.py documents them).
Pure Python, no torch: models/config.py calls `check_mla` from its __post_init__."""

from __future__ import annotations

import math


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention-scale correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1), as DeepSeek and
    transformers compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(cfg) -> float:
    """The softmax scale of latent attention: (qk_nope + qk_rope)^-1/2, times mscale(factor, mscale_all_dim)^2
    under YaRN when mscale_all_dim is set (transformers' yarn_apply_mscale; DeepSeek's softmax_scale)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def yarn_attention_factor(cfg) -> float:
    """What YaRN multiplies cos and sin by: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    mscale_all_dim is set (1 for DeepSeek-V3's equal values), else mscale(factor, mscale)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    top = yarn_mscale(cfg.rope_factor, cfg.rope_mscale)
    return top / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) if cfg.rope_mscale_all_dim else top


MLA_DIMS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_mla(cfg) -> None:
    """Latent attention's and YaRN's fields; messages name the field, the value and what is valid."""
    for field in ("kv_lora_rank", "q_lora_rank", *MLA_DIMS):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"model.{field} = {value!r} is invalid: it must be an integer >= 0")
    for field in ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim"):
        value = getattr(cfg, field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"model.{field} = {value!r} is invalid: it must be a number >= 0")
    if cfg.rope_scaling == "yarn":
        if not cfg.kv_lora_rank:
            raise ValueError("model.rope_scaling = 'yarn' is built for latent attention only (model.kv_lora_rank "
                             "> 0); valid for other attention: 'none', 'llama3'")
        if not (cfg.rope_factor > 0 and cfg.rope_original_positions > 0 and cfg.rope_beta_fast >= cfg.rope_beta_slow):
            raise ValueError(f"model.rope_scaling = 'yarn' needs rope_factor > 0, rope_original_positions > 0 and "
                             f"rope_beta_fast >= rope_beta_slow; got {cfg.rope_factor}, {cfg.rope_original_positions},"
                             f" {cfg.rope_beta_fast}, {cfg.rope_beta_slow}")
    if not cfg.kv_lora_rank:
        set_ = [f for f in ("q_lora_rank", *MLA_DIMS) if getattr(cfg, f)]
        if set_:
            raise ValueError(f"model.{', model.'.join(set_)} set but model.kv_lora_rank = 0: they belong to latent "
                             "attention (kv_lora_rank > 0)")
        return
    missing = [f for f in MLA_DIMS if not getattr(cfg, f)]
    if missing:
        raise ValueError(f"model.kv_lora_rank = {cfg.kv_lora_rank} (latent attention) needs model."
                         f"{', model.'.join(missing)} >= 1")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"model.qk_rope_head_dim = {cfg.qk_rope_head_dim} must be even (rotary pairs)")
    wrong = {"positions": (cfg.positions, "rotary"), "norm": (cfg.norm, "rmsnorm"), "n_kv_head": (cfg.n_kv_head, cfg.n_head),
             "qkv_bias": (cfg.qkv_bias, False), "proj_bias": (cfg.proj_bias, False), "qk_norm": (cfg.qk_norm, False),
             "sliding_window": (cfg.sliding_window, 0), "attention": (cfg.attention, "dense"),
             "head_width": (cfg.head_width, 0)}
    bad = [f"model.{f} = {got!r} (valid: {want!r})" for f, (got, want) in wrong.items() if got != want]
    if bad:
        raise ValueError(f"model.kv_lora_rank = {cfg.kv_lora_rank} (latent attention) cannot be combined with "
                         f"{'; '.join(bad)}")
