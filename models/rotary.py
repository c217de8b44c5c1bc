"""Rotary position embeddings (Su et al. 2021) in Hugging Face Llama's convention, with Llama 3.1's scaling.

The head dimension is two halves [x1, x2]; position p rotates pair (x1[i], x2[i]) by angle p * inv_freq[i]:
x * cos + rotate_half(x) * sin with rotate_half([x1, x2]) = [-x2, x1]. HF's Llama / Qwen2 / Mistral checkpoints
store q_proj and k_proj rows for this convention, so their weights load unpermuted.

`inv_freq` follows transformers' modeling_rope_utils: the default frequencies theta^(-2i/hd) computed in fp32,
and for `rope_scaling = "llama3"` its `_compute_llama3_parameters` (low frequencies divided by rope_factor, high
ones kept, a smooth interpolation between). No weights: every rank computes the tables for its own tokens'
positions (its context-parallel chunks, the decoding offset), so nothing here communicates.
"""

from __future__ import annotations

import math

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.deepseek.fields import yarn_attention_factor
from megazoo.models.deepseek.yarn import yarn_inv_freq


def inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """(head_dim / 2,) fp32 inverse frequencies, exactly as transformers computes them for this config (latent
    attention: its rotary part, qk_rope_head_dim wide)."""
    hd = cfg.qk_rope_head_dim if cfg.mla else cfg.head_dim
    if cfg.rope_scaling == "yarn":
        return yarn_inv_freq(cfg, hd, device)
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    if cfg.rope_scaling == "none":
        return freq
    # llama3: wavelengths longer than original / low_freq_factor are scaled by 1 / factor, shorter than
    # original / high_freq_factor kept, and the ones between interpolated smoothly.
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_positions
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > original / low, freq / factor, freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(cfg: ModelConfig, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (..., s, head_dim), for positions `pos` (..., s) (a packed batch's are (b, s)): angles in
    fp32 (fp64 for an fp64 model), as HF's rotary embedding, then cast to the activations' dtype."""
    angle_dtype = torch.promote_types(dtype, torch.float32)
    freqs = pos.to(angle_dtype)[..., None] * inv_freq(cfg, pos.device).to(angle_dtype)  # (..., s, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = yarn_attention_factor(cfg)  # YaRN's cos / sin factor (1 otherwise), multiplied in as transformers does
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, h, s, hd) rotated by its positions' angles; cos, sin (s, hd)."""
    return x * cos + rotate_half(x) * sin
