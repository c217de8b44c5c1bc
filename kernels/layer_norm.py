"""LayerNorm over the last dimension: y = (x - mean) / sqrt(var + eps) * weight + bias.

Every implementation is fn(x, weight, bias, eps) -> y with y in x's dtype and gradients for all three tensors.
Statistics are computed in fp32 (at least) whatever the input dtype, as torch, apex and Megatron do.

Order (best first, measured): apex FusedLayerNorm (hand-tuned CUDA, one pass forward and backward), torch's
native layer_norm kernel, our Triton kernel (kernels/triton_layer_norm.py), and the reference in plain torch ops.
Torch is ahead of our Triton kernel: on an H100 (torch 2.11, bf16, benchmarks/kernels.py) forward + backward took
0.36 vs 1.13 ms at gpt2-1.5b's 8192 x 1600 and 0.26 vs 1.02 ms at tnlg-17b's 4096 x 4256 (Triton's backward
reduces the weight gradient in partial sums); `auto` picking Triton cost the whole gpt2-1.5b step ~25%.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.kernels.availability import Candidate, HALF_AND_FLOAT, apex_missing, triton_missing


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The definition, in plain ops (autograd derives the backward): fp32 statistics, biased variance."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.to(compute) + bias.to(compute)
    return y.to(x.dtype)


layer_norm_reference.reads_fp32_params = True  # computes in fp32: takes fp32 weight/bias beside a 16-bit x


def layer_norm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's native kernel (what nn.LayerNorm runs): fused forward, fused backward; y in x's dtype."""
    return in_input_dtype(F.layer_norm(x, (x.shape[-1],), weight, bias, eps), x)


def in_input_dtype(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y cast back to x's dtype (a no-op on every path since layer_norm_outside_autocast; kept so that no other
    path can hand an fp32 output to the tensor-parallel region: its backward all-reduce would run in fp32)."""
    return y if y.dtype == x.dtype else y.to(x.dtype)


HALF = (torch.float16, torch.bfloat16)


def half_under_autocast(x: torch.Tensor) -> bool:
    """x is 16-bit and autocast is on for its device: where CUDA autocast would run torch's layer_norm in fp32.
    (A meta tensor has no autocast: torch raises for the question.)"""
    return x.dtype in HALF and x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)


def params_for_kernel(fn, x: torch.Tensor, weight, bias):
    """weight and bias as implementation `fn` takes them beside a 16-bit x. Kept as they are (fp32 under ZeRO-0)
    where the kernel reads fp32 parameters: the reference and the Triton kernel (`reads_fp32_params`: they load
    them as fp32) and torch's CPU kernel (mixed types). Else cast to x's dtype: torch's CUDA kernel reads gamma and
    beta as x's type (`gamma.const_data_ptr<T>()`), as apex's unmixed kernel does - a d-element copy whose
    gradient returns to the fp32 parameter through the cast. Under ZeRO >= 1 they are x's dtype already (no copy)."""
    if getattr(fn, "reads_fp32_params", False) or (fn is layer_norm_torch and x.device.type == "cpu"):
        return weight, bias
    return tuple(p if p is None else p.to(x.dtype) for p in (weight, bias))


def layer_norm_outside_autocast(fn, x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    """fn on a 16-bit x under autocast, with autocast off: y, dx and the input kept for backward in x's dtype,
    mean and 1/std fp32 inside the kernel (what apex's FusedLayerNorm and Megatron's fused LayerNorm do).

    CUDA autocast lists layer_norm among its fp32 ops: it would cast x, weight and bias to fp32, the kernel would
    keep that fp32 copy of x for backward, and y and dx would come out in fp32 - measured on fake CUDA: +1.4%
    activations in every 16-bit tiny config, gpt-100b's peak +15.7% (fp32 copies and gradients in each recomputed
    block). Every implementation computes fp32 statistics from a 16-bit x itself, so nothing is lost. CPU autocast
    leaves layer_norm alone: there this is the same call as under autocast.
    """
    with torch.autocast(x.device.type, enabled=False):
        return in_input_dtype(fn(x, *params_for_kernel(fn, x, weight, bias), eps), x)


def _load_apex():
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine

    def layer_norm_apex(x, weight, bias, eps):
        return fused_layer_norm_affine(x, weight, bias, (x.shape[-1],), eps)

    return layer_norm_apex


def _load_triton():
    from megazoo.kernels.triton_layer_norm import layer_norm_triton
    return layer_norm_triton


CANDIDATES = (
    Candidate("apex", _load_apex, "apex.normalization.fused_layer_norm_affine", apex_missing("fused_layer_norm_cuda"),
              dtypes=HALF_AND_FLOAT),
    Candidate("torch", lambda: layer_norm_torch, "torch.nn.functional.layer_norm"),
    Candidate("triton", _load_triton, "kernels/triton_layer_norm.py (fwd + bwd, fp32 statistics)", triton_missing,
              dtypes=HALF_AND_FLOAT),
    Candidate("reference", lambda: layer_norm_reference, "plain torch ops (kernels/layer_norm.py)"),
)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, names, init and state dict) whose forward runs a chosen implementation.

    Subclassing keeps everything that recognises LayerNorms (initialisation, no weight decay, checkpoint and
    Hugging Face conversion) working unchanged.
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, fn=layer_norm_torch, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if half_under_autocast(x):  # y in x's dtype, not autocast's fp32
            return layer_norm_outside_autocast(self.fn, x, self.weight, self.bias, self.eps)
        if self.fn is layer_norm_torch:  # exactly nn.LayerNorm's call (fp32, fp64, no autocast: unchanged)
            return in_input_dtype(super().forward(x), x)
        return self.fn(x, self.weight, self.bias, self.eps)
