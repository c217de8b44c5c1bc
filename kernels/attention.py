"""Causal self-attention core: y = softmax(q k^T / sqrt(hd), causal) v, with optional dropout on the probabilities.

Every implementation is fn(q, k, v, dropout_p) -> y with q, k, v, y of shape (b, h, s, hd). Dropout draws
from torch's current default generator, so the caller's tensor-parallel RNG fork applies to all of them (the
random masks differ between SDPA and the unfused paths; with dropout 0 they compute the same function).

Order: torch's scaled_dot_product_attention first on every device - on CUDA it runs FlashAttention-2 or the
memory-efficient kernel (never materialising the (s, s) scores), which no unfused path can match. Then the
unfused paths, q k^T -> scaled causal masked softmax -> dropout -> p v, whose softmax is apex's fused CUDA
kernel (Megatron's scaled_upper_triang_masked_softmax), our Triton kernel, or the plain reference.
"recompute" (kernels/recompute_attention.py) is SDPA keeping only q, k, v for backward and recomputing the
rest there, with the same dropout mask: on CPU, where SDPA with dropout runs its math path and keeps the
probabilities, it holds what FlashAttention holds on a GPU (the dry run uses it for that).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megazoo.kernels import recompute_attention
from megazoo.kernels.availability import Candidate, HALF_AND_FLOAT, apex_missing, triton_missing


def scaled_causal_softmax_reference(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * scores) over the last dim, entries above the diagonal masked out; fp32 inside."""
    s = scores.shape[-1]
    x = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
    return x.masked_fill(future, float("-inf")).softmax(dim=-1).to(scores.dtype)


def scaled_causal_softmax_torch(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's softmax kernel with an fp32 accumulator (dtype=), on the masked, scaled scores."""
    s = scores.shape[-1]
    future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax((scores * scale).masked_fill(future, float("-inf")), dim=-1,
                         dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)


class _ApexCausalSoftmax(torch.autograd.Function):
    """apex's fused kernel takes (batch * heads, s, s) fp16/bf16 scores."""

    @staticmethod
    def forward(ctx, scores, scale):
        import scaled_upper_triang_masked_softmax_cuda as ext
        if scores.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"apex's fused causal softmax takes fp16/bf16 scores, got {scores.dtype}; use "
                            f"kernels.attention = \"torch\" (SDPA) or \"triton\" for {scores.dtype}")
        s = scores.shape[-1]
        probs = ext.forward(scores.reshape(-1, s, s).contiguous(), scale)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs.view(scores.shape)

    @staticmethod
    def backward(ctx, grad):
        import scaled_upper_triang_masked_softmax_cuda as ext
        (probs,) = ctx.saved_tensors
        s = probs.shape[-1]
        return ext.backward(grad.reshape(-1, s, s).contiguous(), probs, ctx.scale).view(grad.shape), None


def scaled_causal_softmax_apex(scores: torch.Tensor, scale: float) -> torch.Tensor:
    return _ApexCausalSoftmax.apply(scores, scale)


def unfused_attention(softmax):
    """Attention from explicit matmuls around `softmax(scores, scale)` (materialises the (b, h, s, s) scores)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1)  # (b, h, s, s)
        probs = softmax(scores, 1.0 / math.sqrt(q.shape[-1]))
        if dropout_p > 0:
            probs = F.dropout(probs, dropout_p)
        return probs @ v  # (b, h, s, hd)

    attend.softmax = softmax
    return attend


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """torch's fused attention (flash / memory-efficient / cuDNN on CUDA, a fused CPU kernel on CPU)."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


attention_reference = unfused_attention(scaled_causal_softmax_reference)


def _load_triton():
    from megazoo.kernels.triton_softmax import scaled_causal_softmax_triton
    return unfused_attention(scaled_causal_softmax_triton)


def sdpa_backends() -> str:
    """The SDPA backends torch may choose from here (it picks per call by dtype, shape and hardware)."""
    import megazoo.parallel.accelerator as accelerator

    if not accelerator.cuda_available():
        return "CPU fused kernel"
    b = torch.backends.cuda
    switches = (("flash", b.flash_sdp_enabled()), ("memory-efficient", b.mem_efficient_sdp_enabled()),
                ("cudnn", b.cudnn_sdp_enabled()), ("math", b.math_sdp_enabled()))
    enabled = [name for name, on in switches if on]
    return "CUDA backends " + " > ".join(enabled)


CANDIDATES = (
    Candidate("torch", lambda: attention_sdpa, f"scaled_dot_product_attention(is_causal=True): {sdpa_backends()}"),
    # SDPA that keeps q, k, v only (kernels/recompute_attention.py): what FlashAttention keeps, on any device, for
    # one more attention forward in backward. Never auto-picked (torch always runs), only by kernels.attention.
    Candidate("recompute", lambda: recompute_attention.attention_recompute, recompute_attention.DETAIL),
    # Both below hold the (b, h, s, s) scores: only an explicit kernels.attention picks them, never `prefer`.
    Candidate("apex", lambda: unfused_attention(scaled_causal_softmax_apex),
              "q k^T -> apex scaled_upper_triang_masked_softmax -> p v", apex_missing(
                  "scaled_upper_triang_masked_softmax_cuda"), dtypes=(torch.bfloat16, torch.float16),
              by_prefer=False),
    Candidate("triton", _load_triton, "q k^T -> kernels/triton_softmax.py scaled causal softmax -> p v",
              triton_missing, dtypes=HALF_AND_FLOAT, by_prefer=False),
    Candidate("reference", lambda: attention_reference, "q k^T -> plain masked softmax (fp32) -> p v"),
)
