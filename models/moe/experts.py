"""The routed experts' computation: bias-free SwiGLUs, stacked, run over tokens already sorted by expert.

    expert_ffn(tokens, counts, w_fc, w_proj) = down_e(silu(gate_e x) * up_e x) for each row x of expert e

tokens (N, d) are sorted by local expert (counts (n,) rows each); w_fc (n, 2 f, d) stacks [gate; up] per expert
and w_proj (n, d, f) the down projections, torch.nn.Linear's (out, in) per expert as transformers stores them
(gate_up_proj, down_proj). "grouped" runs each of the two matmuls as ONE grouped matmul (torch._grouped_mm with
the experts' row offsets: no loop, no host read of the counts); "loop" is the per-expert reference (it reads the
counts on the host) that the grouped one is tested against, and the fallback where torch's grouped matmul does not
run: on CPU it takes fp32 / bf16 / fp16 only (no fp64) and needs rows 16-byte aligned (d and f multiples of 4 in
fp32, of 8 in 16 bits), and on CUDA a kernel on sm90 / sm100 only (GROUPED_CUDA_MAJORS); `grouped_mm_unsupported`
says why, and the module records it in `fallback`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.parallel.expert import device_capability, host_row_counts

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# CUDA compute capabilities (major) whose grouped matmul is a kernel: torch's CUDA _grouped_mm (aten's
# GroupedBlas.cpp) runs its CUTLASS kernel on sm90 / sm100 only; on any other device it loops over the groups itself
# after copying the offsets to the host (_grouped_mm_fallback): the per-expert loop, with its host read, untested
# here and slower than ours. (torch.nn.functional.grouped_mm's own docstring says SM >= 80; its inductor lowering
# needs (9, 0).)
GROUPED_CUDA_MAJORS = (9, 10)


def cuda_capability(device) -> tuple[int, int] | None:
    """The CUDA device's compute capability (the accelerator's runtime: the dry run's fake CUDA answers 9.0), None
    off CUDA."""
    if device is None or torch.device(device).type != "cuda":
        return None
    capability = device_capability(torch.device(device))
    return tuple(capability) if capability is not None else None


def grouped_mm_unsupported(dtype: torch.dtype, d: int, f: int, device=None) -> str | None:
    """Why torch's grouped matmul cannot run these experts (None: it can); `device`: where (its CUDA capability)."""
    if not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no grouped matmul"
    capability = cuda_capability(device)
    if capability is not None and capability[0] not in GROUPED_CUDA_MAJORS:
        return (f"torch's grouped matmul has a CUDA kernel on sm90 and sm100 only; this GPU is sm"
                f"{capability[0]}{capability[1]}, where torch would loop over the experts itself (with a host "
                f"read of the offsets): the per-expert loop runs instead")
    if dtype not in GROUPED_DTYPES:
        return f"torch's grouped matmul takes fp32, bf16 or fp16, not {dtype}"
    align = 16 // torch.empty((), dtype=dtype).element_size()
    if d % align or f % align:
        return f"torch's grouped matmul needs 16-byte aligned rows: d_model = {d} and moe_d_ff = {f} must be " \
               f"multiples of {align} in {dtype}"
    return None


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


class _Contiguous(torch.autograd.Function):
    """Identity whose gradient is made contiguous: the grouped matmul's backward refuses expanded (stride 0)
    gradients, such as those of a plain `.sum()`."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_swiglu(tokens: torch.Tensor, counts: torch.Tensor, w_fc: torch.Tensor,
                   w_proj: torch.Tensor) -> torch.Tensor:
    """Both matmuls as one grouped matmul each; `counts` stays on the device (offsets: its cumulative sum)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = _grouped_mm(tokens.contiguous(), w_fc.transpose(1, 2), offs)  # (N, 2f)
    gate, up = h.chunk(2, dim=-1)
    h = (F.silu(gate) * up).contiguous()  # (N, f)
    return _Contiguous.apply(_grouped_mm(h, w_proj.transpose(1, 2), offs))  # (N, d)


def looped_swiglu(tokens: torch.Tensor, counts: torch.Tensor, w_fc: torch.Tensor,
                  w_proj: torch.Tensor) -> torch.Tensor:
    """The reference: one SwiGLU per expert on its rows (reads the counts on the host; on the dry run's fake
    tensors, which hold no counts, the rows split evenly: parallel/expert.host_row_counts)."""
    outs = []
    # unbind, not w_fc[e]: each indexing's backward would write a zero gradient of the whole stack (E^2 work)
    fcs, projs = w_fc.unbind(0), w_proj.unbind(0)
    for e, rows in enumerate(tokens.split(host_row_counts(counts, tokens.shape[0]))):
        gate, up = F.linear(rows, fcs[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, projs[e]))
    return torch.cat(outs) if outs else tokens.new_zeros(0, w_proj.shape[1])


def expert_ffn(tokens: torch.Tensor, counts: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor,
               impl: str = "grouped") -> torch.Tensor:
    """(N, d) expert outputs of tokens sorted by local expert (module docstring). impl "grouped" falls back to the
    loop where the grouped matmul cannot run (grouped_mm_unsupported)."""
    if impl == "grouped" and grouped_mm_unsupported(tokens.dtype, w_proj.shape[1], w_proj.shape[2],
                                                    tokens.device) is None:
        return grouped_swiglu(tokens, counts, w_fc, w_proj)
    return looped_swiglu(tokens, counts, w_fc, w_proj)


class ExpertWeights(nn.Module):
    """One stacked expert matrix (n_local, out, in): `weight`; `init_std` for models/weights.py."""

    def __init__(self, n_local: int, out: int, inp: int, init_std: float, device=None, dtype=None):
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(n_local, out, inp, device=device, dtype=dtype))


class ExpertComputation(nn.Module):
    """The local experts: c_fc (n, 2 f, d) [gate; up] and c_proj (n, d, f), replicated over tp (expert-tp 1).

    Call it as experts(tokens, counts) (the dispatcher's interface, models/moe/__init__.py). `replicated` wraps the
    weights where each tp rank computes different tokens (sequence parallelism: gradients all-reduced over tp).
    `fallback`: why the grouped matmul will not run for this module's dtype (None: it runs), fixed at build time
    for the weights' dtype; autocast to a supported dtype still takes the grouped path."""

    def __init__(self, n_local: int, d: int, f: int, init_std: float, proj_std: float, impl: str = "grouped",
                 device=None, dtype=None, *, replicated=None):
        super().__init__()
        self.impl, self.n_local = impl, n_local
        self.replicated = replicated if replicated is not None else (lambda p: p)
        self.c_fc = ExpertWeights(n_local, 2 * f, d, init_std, device=device, dtype=dtype)
        self.c_proj = ExpertWeights(n_local, d, f, proj_std, device=device, dtype=dtype)
        dtype = dtype or torch.get_default_dtype()
        self.fallback = grouped_mm_unsupported(dtype, d, f, device) if impl == "grouped" else None

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w_fc, w_proj = self.replicated(self.c_fc.weight), self.replicated(self.c_proj.weight)
        if torch.is_autocast_enabled(tokens.device.type):
            dtype = torch.get_autocast_dtype(tokens.device.type)
            tokens, w_fc, w_proj = tokens.to(dtype), w_fc.to(dtype), w_proj.to(dtype)
        return expert_ffn(tokens, counts, w_fc, w_proj, self.impl)


def capacity(factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """Rows one expert takes at most under a capacity factor (GShard / Switch): ceil(factor x T x k / E)."""
    return math.ceil(factor * tokens * top_k / n_experts)
