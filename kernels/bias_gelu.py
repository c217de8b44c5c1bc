"""Bias add + tanh-approximated GELU (GPT-2's activation), fused: y = gelu_tanh(x + bias).

Every implementation is fn(x, bias) -> y, bias broadcast over x's last dimension, with gradients for both.
In the MLP, c_fc then runs its matmul without the bias and this op adds it (Megatron's bias_gelu fusion): one
read and one write of the (b, s, d_ff / tp) activation instead of three, and backward recomputes x + bias rather
than storing it.

Order (measured): torch (native GELU kernel after the bias add), our Triton kernel (one elementwise pass each way),
and the reference formula in plain ops. apex has no bias-GELU kernel. On an H100 (torch 2.11, bf16,
benchmarks/kernels.py) forward + backward took 0.51 (torch) vs 0.72 ms (Triton) at gpt2-1.5b's 8192 x 6400 and
0.63 vs 0.68 ms at tnlg-17b's 4096 x 17024: Triton's forward is faster, its backward is not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megazoo.kernels.availability import Candidate, HALF_AND_FLOAT, triton_missing

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_COEF = 0.044715


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), z = x + bias, computed in fp32 (at least)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    z = x.to(compute) + bias.to(compute)
    y = 0.5 * z * (1.0 + torch.tanh(SQRT_2_OVER_PI * (z + GELU_COEF * z * z * z)))
    return y.to(x.dtype)


def bias_gelu_torch(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """torch's native tanh-GELU kernel on x + bias (two elementwise kernels; GELU's backward is fused)."""
    return F.gelu(x + bias, approximate="tanh")


def _load_triton():
    from megazoo.kernels.triton_bias_gelu import bias_gelu_triton
    return bias_gelu_triton


CANDIDATES = (
    Candidate("torch", lambda: bias_gelu_torch, "torch.nn.functional.gelu(approximate='tanh'); "
              "in the MLP the bias is added inside c_fc's GEMM (addmm)"),
    Candidate("triton", _load_triton, "kernels/triton_bias_gelu.py (bias add + tanh-GELU, fwd + bwd)",
              triton_missing, dtypes=HALF_AND_FLOAT),
    Candidate("reference", lambda: bias_gelu_reference, "plain torch ops (kernels/bias_gelu.py)"),
)
