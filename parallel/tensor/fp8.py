"""FP8 linear layers (train.fp8): y = x W^T with x, W and dy quantized to float8 with dynamic scales.

Recipes (the two of torchao's float8 training and Megatron-core, "current" / dynamic scaling: each scale from this
step's own amax):

    recipe       operands                   scale                                   grad_output
    tensorwise   x, W: e4m3 (max 448)       one per tensor: 448 / amax              e5m2 (max 57344), per tensor
    rowwise      x, W: e4m3                 one per row along each matmul's          e4m3, per row
                                            reduction dim: 448 / amax(|row|)

Three matmuls per linear, each on quantized operands (the rowwise scales always lie along the matmul's own
reduction dim, so they factor out of the sum):

    forward  y  = x  W^T     (M, K) x (N, K)^T     x rows over K,  W rows over K
    dgrad    dx = dy W       (M, N) x (N, K)       dy rows over N, W columns over N
    wgrad    dW = dy^T x     (N, M) x (M, K)       dy columns over M, x columns over M

Where a matmul runs: CUDA, torch._scaled_mm (the FP8 tensor cores of sm_89+: Ada, Hopper, Blackwell; the second
operand column-major, scales the inverse ones, fp32); anywhere else the same numbers emulated: the float8 values
dequantized to fp32 and multiplied in fp32 (fp64 for an fp64 model, so that parity tests see the 8-bit rounding
alone). The output is in the matmul dtype (the autocast dtype, else x's).

Tensor parallelism computes the solo model's function: an operand sharded over tp along the dim a scale reduces
(or any shard, tensorwise) takes its amax all-reduced (MAX) over the tp group, so every rank quantizes with the
scale the unsharded tensor would have. Column-parallel: W and dy are sharded along N; row-parallel: x and W
along K. Collectives: those small all-reduces only (none at tp = 1).

Only the blocks' attention and MLP projections run in FP8 (`enable_fp8`); the embedding, the head, the norms and
anything else keep the model's precision, and the master weights and checkpoints their dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazoo.parallel import accelerator
from megazoo.parallel.collectives import all_reduce

RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale
CHUNK_ELEMENTS = 1 << 24  # quantize's wide copy: at most this many elements at a time (64 MB in fp32)


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None, group=None, sharded: int | None = None):
    """(t * scale in `dtype`, scale fp32): scale = max(dtype) / amax, over the whole tensor (dim None) or per
    slice along `dim` (keepdim). `sharded`: the dim along which t is split over `group`; its amax is all-reduced
    where the amax spans it."""
    # Memory: max |t| is exact in t's own dtype, so the amax is a reduction with no copy of t; the scaling runs
    # on a wide copy of at most CHUNK_ELEMENTS at a time, scaled and clamped in place. Beside t: its 1-byte copy
    # and one chunk's wide copy (an fp32 copy of |t| and two whole wide copies before: 12 bytes per element at
    # the peak, 0.4 GB for one MLP weight of Llama 3.2 1B). recipes/planner/activations.py fp8_workspace counts it.
    t = t.detach()
    amax = torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=dim is not None).float()
    if group is not None and sharded is not None and (dim is None or dim == sharded):
        amax = all_reduce(amax.contiguous(), group, dist.ReduceOp.MAX)
    top = torch.finfo(dtype).max
    scale = top / amax.clamp(min=EPS)
    wide = torch.promote_types(t.dtype, torch.float32)  # fp64 stays fp64 up to the 8-bit rounding itself
    q = torch.empty(t.shape, dtype=dtype, device=t.device)
    step = max(1, CHUNK_ELEMENTS // max(1, t[0].numel())) if t.dim() else 1
    for start in range(0, max(1, t.shape[0] if t.dim() else 1), step):
        rows = slice(start, start + step) if t.dim() else ...
        s = scale[rows] if scale.dim() and scale.shape[0] > 1 else scale  # per row (dim 1) or per column / whole
        q[rows] = t[rows].to(wide, copy=True).mul_(s).clamp_(-top, top)
    return q, scale


def scaled_matmul(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
                  emulate: bool) -> torch.Tensor:
    """(a / sa) @ (b / sb): a (M, K) with sa () or (M, 1); b (K, N) with sb () or (1, N)."""
    if emulate:  # products of 8-bit values are exact in fp32; an fp64 model (parity tests) also sums in fp64
        wide = torch.promote_types(out_dtype, torch.float32)
        return ((a.to(wide) / sa) @ (b.to(wide) / sb)).to(out_dtype)
    # cuBLASLt's FP8 GEMM: b column-major; scales are the dequantizing ones; rowwise scaling writes bf16 only
    out = torch.bfloat16 if sa.dim() > 0 else out_dtype if out_dtype != torch.float64 else torch.float32
    y = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa.reciprocal().float(),
                         scale_b=sb.reciprocal().float(), out_dtype=out)
    return y.to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe, group, x_sharded, w_sharded, g_sharded, out_dtype, emulate):
        rowwise = recipe == "rowwise"
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = quantize(x2, E4M3, 1 if rowwise else None, group, x_sharded)
        qw, sw = quantize(weight, E4M3, 1 if rowwise else None, group, w_sharded)
        y = scaled_matmul(qx, sx, qw.t(), sw.t() if rowwise else sw, out_dtype, emulate)
        ctx.save_for_backward(x2, weight)  # high precision; backward quantizes along its own dims
        ctx.args = (recipe, group, x_sharded, w_sharded, g_sharded, emulate, x.shape, x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        recipe, group, x_sharded, w_sharded, g_sharded, emulate, x_shape, x_dtype = ctx.args
        rowwise = recipe == "rowwise"
        g = dy.reshape(-1, dy.shape[-1])
        gdt = E4M3 if rowwise else E5M2
        dx = dw = None
        qg = None
        if ctx.needs_input_grad[0]:  # dx = dy W, reduction over N
            qg, sg = quantize(g, gdt, 1 if rowwise else None, group, g_sharded)
            qw, sw = quantize(weight, E4M3, 0 if rowwise else None, group, w_sharded)
            dx = scaled_matmul(qg, sg, qw, sw, dy.dtype, emulate).view(x_shape).to(x_dtype)
            del qw  # gone before dW's operands exist (the planner's fp8_workspace: one matmul's at a time)
            if rowwise:  # rowwise scales dy along the other dim for dW; tensorwise's one scale serves both
                qg = None
        if ctx.needs_input_grad[1]:  # dW = dy^T x, reduction over M (tokens: never sharded over tp here)
            if qg is None:
                qg, sg = quantize(g, gdt, 0 if rowwise else None, group, g_sharded)
            qx, sx = quantize(x2, E4M3, 0 if rowwise else None, group, x_sharded)
            # written in the weight's dtype: the GEMM accumulates in fp32 and rounds once either way (an fp32
            # product cast after cost 4 bytes per weight element more at the peak)
            dw = scaled_matmul(qg.t(), sg.t() if rowwise else sg, qx, sx, weight.dtype, emulate)
        return dx, dw, None, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str, *, group=None,
               parallel: str = "none") -> torch.Tensor:
    """F.linear(x, weight, bias) with its three matmuls in FP8 (`recipe`); bias added after, in the output dtype.
    `parallel`: "column" (weight and dy sharded along N over `group`), "row" (x and weight along K), "none"."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is invalid; valid: {', '.join(RECIPES)}")
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if parallel == "none" or group is None:
        sharded = (None, None, None)
    else:
        sharded = {"column": (None, 0, 1), "row": (1, 1, None)}[parallel]
    emulate = device != "cuda"
    with torch.autocast(device, enabled=False):
        y = _FP8Linear.apply(x, weight, recipe, group, *sharded, out_dtype, emulate)
        return y if bias is None else y + bias.to(out_dtype)


def check_fp8_device(device: torch.device) -> None:
    """FP8 matmuls need sm_89+ on CUDA; elsewhere they are emulated. A clear error before the first step."""
    if device.type == "cuda":
        major, minor = accelerator.device_capability(device)
        if (major, minor) < (8, 9):
            raise RuntimeError(f"train.fp8 needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, "
                               f"Blackwell); {accelerator.device_name(device)} has {major}.{minor}. Set "
                               "train.fp8 = \"none\"")


def fp8_problem(cfg, tp: int, precision: str, lora: bool) -> str | None:
    """Why train.fp8 cannot run with this model / layout, or None. FP8 GEMMs (cuBLASLt) need every matmul dim a
    multiple of 16: the local widths of the projections are checked here, the tokens per micro-batch at run time."""
    if precision == "fp16":
        return "train.precision = 'fp16' (its loss scaling is not combined with FP8's own scales); valid: 'bf16'"
    if lora:
        return "LoRA adapters (their frozen base would be quantized every step); valid: lora.rank = 0"
    hd = cfg.d_model // cfg.n_head
    widths = {"model.d_model": cfg.d_model, "model.d_ff / tp": cfg.d_ff // tp,
              "query width n_head x head_dim / tp": cfg.n_head * hd // tp}
    bad = {k: v for k, v in widths.items() if v % 16}
    if bad:
        return f"FP8 matmuls need dims that are multiples of 16: {bad}"
    return None


def enable_fp8(model: torch.nn.Module, recipe: str) -> list[str]:
    """Turn FP8 on for the attention and MLP projections of every block (`model.h`); returns their names."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is invalid; valid: {', '.join(RECIPES)}")
    names = []
    for i, block in getattr(model, "h", {}).items():
        for part in ("attn", "mlp"):
            for name, module in getattr(block, part).named_modules():
                # Column- and RowParallelLinear (layers.py imports this module); a MoE router stays high precision
                if hasattr(module, "fp8") and "router" not in name:
                    module.fp8 = recipe
                    names.append(f"h.{i}.{part}.{name}")
    return names


__all__ = ["RECIPES", "check_fp8_device", "enable_fp8", "fp8_linear", "fp8_problem", "quantize", "scaled_matmul"]
