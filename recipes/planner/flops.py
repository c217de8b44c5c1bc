"""Model FLOPs per token and the GPU's spec peak, for model FLOPs utilisation (MFU) in the step metrics.

MFU as PaLM defines it: the FLOPs the model needs (not counting activation recomputation) per second, over
the hardware's peak. Per token of training: 6 x the parameters that take part in matmuls (forward 2, backward
4) plus 12 x layers x sequence x hidden for the attention scores and their weighted sum (q k^T and p v, full
square, the usual convention). Peaks are the vendors' dense (no sparsity) tensor-core figures for the compute
dtype; an unknown GPU, or the CPU, has none and gets no MFU.
"""

from __future__ import annotations

import torch

from megazoo.models.config import ModelConfig
from megazoo.parallel import accelerator

# Dense peak FLOP/s by GPU and compute dtype (NVIDIA data sheets; SXM parts; fp32 matmuls run as TF32).
PEAK_FLOPS = {
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12},
    "H100 PCIe": {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 378e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 156e12},
    "V100": {torch.float16: 125e12, torch.float32: 15.7e12},
}


def model_flops_per_token(cfg: ModelConfig, seq_len: int, vocab: int | None = None) -> float:
    """Training FLOPs per token: 6 x matmul parameters (blocks + the output head) + 12 x L x s x d."""
    d, vocab = cfg.d_model, vocab or cfg.vocab_size
    matmul_params = cfg.n_layer * (4 * d * d + 2 * d * cfg.d_ff) + vocab * d
    return 6.0 * matmul_params + 12.0 * cfg.n_layer * seq_len * d


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak for `dtype`, or None when unknown (the CPU, an unlisted GPU or dtype)."""
    if device.type != "cuda":
        return None
    name = accelerator.device_name(device)
    for key, peaks in PEAK_FLOPS.items():  # "H100 PCIe" before "H100": the first match wins
        if key in name:
            return peaks.get(dtype)
    return None
