"""YaRN rope scaling (Peng et al. 2023) as DeepSeek-V3 and transformers' `_compute_yarn_parameters` compute it.

Frequencies whose wavelength fits many times in the pretraining context (the high ones) are kept, the low ones
divided by rope_factor, and a linear ramp over the dimensions between blends the two; the ramp's ends are the
dimensions that rotate beta_fast and beta_slow times over rope_original_positions (floored / ceiled, transformers'
`truncate`). The attention-scale correction (mscale) is models/deepseek/fields.py's: the softmax scale and
cos / sin factors, which need no torch.
"""

from __future__ import annotations

import math

import torch


def _correction_dim(rotations: float, dim: int, base: float, positions: int) -> float:
    """The dimension whose frequency turns `rotations` times over `positions`."""
    return dim * math.log(positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(cfg, dim: int, device=None) -> torch.Tensor:
    """(dim / 2,) fp32 inverse frequencies of YaRN for a rotary part `dim` wide (DeepSeek: qk_rope_head_dim)."""
    base, factor = cfg.rope_theta, cfg.rope_factor
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low = max(math.floor(_correction_dim(cfg.rope_beta_fast, dim, base, cfg.rope_original_positions)), 0)
    high = min(math.ceil(_correction_dim(cfg.rope_beta_slow, dim, base, cfg.rope_original_positions)), dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolated), 0: divided by the factor (interpolated)
    return interpolation * (1 - keep) + extrapolation * keep
