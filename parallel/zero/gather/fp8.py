"""FP8 all-gather of ZeRO-3 weights (zero.fp8_all_gather = true, with train.fp8 = "tensorwise").

The weights of the FP8 linears (parallel/tensor/fp8.py: the blocks' attention and MLP projections) sit in their
own bucket of each unit. Their gather sends float8 e4m3 (1 byte per element: half of bf16, a quarter of fp32)
instead of the parameters' dtype; every other parameter (norms, biases, embeddings) is gathered as it is.

Scales: tensorwise, one per weight, 448 / amax(|W|) over the whole (tp-local) weight, exactly the scale the FP8
linear takes for W. A rank owns a piece of each weight only, so each rank takes the amax of its pieces and one
all-reduce (MAX) of those amaxes over the shard group gives every rank every weight's full amax (and one over
tp for tp-sharded weights, whose FP8 scale spans the tp ranks). The scales are
computed at a bucket's first gather after an optimizer step (the forward's) and reused by its backward gather,
so forward and backward compute with the same weights; `invalidate()` (each step, each load) drops them.

Exactness: the gathered weight is q / s with q = e4m3(W s). Its amax is 448 / s (the element at the amax maps to
448 exactly), so the FP8 linear's own quantization of it finds the same scale (up to one rounding of 448 / (448 /
s)) and the same e4m3 values: FP8 training with this gather computes what it computes with a full-precision
gather, up to fp32 rounding of the scale (tests/parallel/zero/test_fp8_all_gather.py). The owned chunks (the fp32
masters) are never quantized, nor the gathers for export and checkpoints (ZeroStage3.gathered()). Rowwise FP8
quantizes W twice (along K for the forward, along N for dgrad), which one gathered copy cannot serve: refused.

Collectives per gather of such a bucket: one all-gather of uint8 (the float8 bits) over the shard group; per
step, one all-reduce (MAX) of one fp32 per weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from megazoo.parallel.collectives import CommLedger, all_gather_flat, all_reduce
from megazoo.parallel.zero.buckets import Bucket

E4M3 = torch.float8_e4m3fn
TOP = torch.finfo(E4M3).max  # 448
EPS = 1e-12  # as fp8.py: an all-zero weight gets a finite scale
CHUNK_ELEMENTS = 1 << 24  # as fp8.py: the wide copies of quantize and dequantize, at most this many at a time


def fp8_weight_names(model: nn.Module) -> set[str]:
    """The parameters the FP8 linears quantize tensorwise: `<module>.weight` of every module with fp8 set."""
    return {f"{name}.weight" for name, m in model.named_modules() if getattr(m, "fp8", None) == "tensorwise"}


def fp8_gather_problem(model: nn.Module, stage: int, quantized_weights: bool, hpz: bool) -> str | None:
    """Why zero.fp8_all_gather cannot run here (None: it can)."""
    recipes = {getattr(m, "fp8", None) for m in model.modules()} - {None}
    if stage != 3:
        return f"it needs zero.stage = 3 (got {stage}): only stage 3 gathers weights for compute"
    if recipes != {"tensorwise"}:
        return (f"it needs train.fp8 = 'tensorwise' (the model's FP8 recipes: {sorted(recipes) or 'none'}); "
                "rowwise quantizes each weight twice, along each matmul's reduction dim")
    if quantized_weights or hpz:
        return "it replaces zero.quantized_weights and does not combine with zero.hpz; set both to false"
    return None


class Fp8Gather:
    """Scales and gathers of the FP8 buckets of one ZeRO-3 optimizer."""

    def __init__(self, group, size: int, ledger: CommLedger, tp_group=None):
        self.group, self.size, self.ledger = group, size, ledger
        self.tp_group = tp_group  # a tp-sharded weight's FP8 scale spans the tp ranks too (fp8.py's quantize)
        self._scales: dict[int, torch.Tensor] = {}  # id(bucket) -> fp32 scale per parameter, this step

    def invalidate(self) -> None:
        self._scales.clear()

    @staticmethod
    def _pieces(bucket: Bucket):
        """(parameter index, start, end) of the owned chunk's part of each parameter, chunk-relative."""
        lo, hi = bucket.owned.start, bucket.owned.stop
        for i, (p, off) in enumerate(zip(bucket.params, bucket.offsets)):
            start, end = max(off, lo), min(off + p.numel(), hi)
            if start < end:
                yield i, start - lo, end - lo

    def scales(self, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
        key = id(bucket)
        if key not in self._scales:
            amax = torch.zeros(len(bucket.params), dtype=torch.float32, device=shard.device)
            for i, a, b in self._pieces(bucket):
                amax[i] = shard[a:b].detach().abs().max().float()
            all_reduce(amax, self.group, dist.ReduceOp.MAX, ledger=self.ledger)
            if bucket.tp_sharded:
                all_reduce(amax, self.tp_group, dist.ReduceOp.MAX, ledger=self.ledger)
            self._scales[key] = TOP / amax.clamp(min=EPS)
        return self._scales[key]

    def quantize(self, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
        """The owned chunk as float8 e4m3 bits (uint8), each parameter's piece times its scale."""
        scales = self.scales(bucket, shard)
        q = torch.zeros(shard.numel(), dtype=E4M3, device=shard.device)  # padding: 0
        wide = torch.promote_types(shard.dtype, torch.float32)
        for i, lo, hi in self._pieces(bucket):
            for a in range(lo, hi, CHUNK_ELEMENTS):  # one chunk's wide copy at a time
                b = min(a + CHUNK_ELEMENTS, hi)
                q[a:b] = shard[a:b].to(wide, copy=True).mul_(scales[i].to(wide)).clamp_(-TOP, TOP)
        return q.view(torch.uint8)

    def gather(self, bucket: Bucket, out: torch.Tensor, shard: torch.Tensor) -> "_Dequantize":
        """Launch the uint8 all-gather of `shard` quantized; waiting it writes q / s into `out` (the flat buffer)."""
        q = self.quantize(bucket, shard)
        q_all = torch.empty(self.size * q.numel(), dtype=torch.uint8, device=q.device)
        work = all_gather_flat(q_all, q, self.group, async_op=True, ledger=self.ledger, kind="all_gather_fp8")
        return _Dequantize(work, q_all, out, bucket, self._scales[id(bucket)])


class _Dequantize:
    def __init__(self, work, q_all: torch.Tensor, out: torch.Tensor, bucket: Bucket, scales: torch.Tensor):
        self._work, self._args = work, (q_all, out, bucket, scales)

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._args is not None:
            q_all, out, bucket, scales = self._args
            self._args = None
            values = q_all.view(E4M3)
            wide = torch.promote_types(out.dtype, torch.float32)
            for p, off, s in zip(bucket.params, bucket.offsets, scales.to(wide)):
                for a in range(off, off + p.numel(), CHUNK_ELEMENTS):  # a chunk's wide copy at a time, cast in
                    b = min(a + CHUNK_ELEMENTS, off + p.numel())  # place (a whole weight's, 10 bytes an element)
                    out[a:b] = values[a:b].to(wide).div_(s)
            out[bucket.offsets[-1] + bucket.params[-1].numel():].zero_()
        return True
