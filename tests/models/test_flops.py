"""MFU's two halves: model FLOPs per token (held to Megatron-LM's closed form) and the GPU's spec peak; TF32."""

from __future__ import annotations

import pytest
import torch

from megazoo.models.presets import get_preset
from megazoo.models.flops import model_flops_per_token
from megazoo.recipes.gpus import peak_flops
from megazoo.recipes.gpus import GPUS
from megazoo.recipes.training.model_setup import configure_matmuls


@pytest.mark.parametrize("preset, seq", [("gpt2-117m", 1024), ("gpt2-1.5b", 1024), ("tnlg-17b", 1024),
                                         ("gpt3-175b", 2048)])
def test_flops_per_token_is_megatrons_formula(preset, seq):
    """Narayanan et al. (2021): 72 L h^2 (1 + s / 6h + V / 12hL) per token, without recomputation (d_ff = 4h)."""
    cfg = get_preset(preset)
    L, h, V = cfg.n_layer, cfg.d_model, cfg.vocab_size
    megatron = 72 * L * h * h * (1 + seq / (6 * h) + V / (12 * h * L))
    assert model_flops_per_token(cfg, seq) == pytest.approx(megatron, rel=1e-12)
    assert model_flops_per_token(get_preset("gpt2-117m"), 1024) == 854_438_400


def test_peak_flops_by_device_name():
    for name, dtype, peak in [("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 PCIe", "bf16", 756e12),
                              ("NVIDIA H200", "fp32", 494e12), ("NVIDIA A100-SXM4-80GB", "fp16", 312e12),
                              ("Tesla V100-SXM2-32GB", "bf16", None), ("NVIDIA GeForce GTX 1080", "fp32", None)]:
        assert peak_flops(name, dtype) == peak, name
    assert peak_flops(None, "fp32") is None  # the CPU


def test_gpu_peaks_are_stated_once():
    """The planner's 16-bit peak per named GPU is the MFU's peak for that part: one table (recipes/gpus.py)."""
    for gpu in GPUS.values():
        assert gpu.peak_flops == max(peak_flops(f"NVIDIA {gpu.device_name}", d) or 0 for d in ("bf16", "fp16"))
    assert GPUS["v100-32gb"].peak_flops == 125e12 and GPUS["h100-80gb"].peak_flops == 989e12

def test_tf32_is_set_on_gpu_only():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        configure_matmuls(torch.device("cpu"), True)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
        configure_matmuls(torch.device("cuda", 0), True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        configure_matmuls(torch.device("cuda", 0), False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("preset", ["llama3.2-1b", "llama3.1-8b", "llama3.1-405b", "qwen2.5-72b", "mistral-7b",
                                    "gpt2-117m"])
def test_flops_count_the_layouts_matrices(preset):
    """The matmul parameters behind 6 N are the blocks' 2-D weights of models/layout.py (SwiGLU's three matrices,
    GQA's smaller K/V) plus the head; the attention term sees at most the sliding window."""
    from megazoo.models.layout import parameter_layout
    from megazoo.models.flops import block_matmul_params

    cfg = get_preset(preset)
    matrices = sum(p.numel for p in parameter_layout(cfg, vocab=cfg.vocab_size)
                   if p.name.startswith("h.") and len(p.shape) == 2)
    assert cfg.n_layer * block_matmul_params(cfg) == matrices
    seq = 8192
    keys = min(seq, cfg.sliding_window or seq)
    expected = 6 * (matrices + cfg.vocab_size * cfg.d_model) + 12 * cfg.n_layer * keys * cfg.d_model
    assert model_flops_per_token(cfg, seq) == expected
