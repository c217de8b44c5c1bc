"""qwZ (ZeRO++, Wang et al. 2023): stage 3's parameter all-gather in int8 blocks.

Each rank cuts its owned chunk into blocks of QWZ_BLOCK = 256 elements (the last one zero-padded), takes each
block's scale s = max|x| / 127 (in the parameter's dtype, at least fp32) and sends q = round(x / s) as int8
plus one scale per block: 1 + 4/256 bytes per element instead of 2 (bf16) or 4 (fp32). Every rank dequantizes
q x s into the gathered buffer. Rounding to the nearest step bounds the error of every element by s / 2 =
max|block| / 254 (plus the dtype's rounding of x / s and q x s).

Only the gathered copy the forward and backward compute with is quantized: the owned chunks (fp32 masters,
AdamW's input and output) never are, nor the gathers that read full weights (export, checkpoints). Collectives:
two all-gathers over the same group (int8 values, then scales), launched together; the dequantization runs when
the gather is waited.
"""

from __future__ import annotations

import torch

from megazoo.parallel.collectives import CommLedger, all_gather_flat

QWZ_BLOCK = 256  # elements per quantization block (one scale each)
QMAX = 127  # symmetric int8: -127..127 (no -128, so the grid is symmetric about 0)


def quantize_blocks(x: torch.Tensor, block: int = QWZ_BLOCK, qmax: int = QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values of ceil(n / block) x block elements, one scale per block) of the 1-D tensor `x`, on the
    symmetric grid -qmax..qmax (127: int8; qgZ's int4 passes 7)."""
    n = x.numel()
    blocks = -(-n // block)
    dtype = torch.promote_types(x.dtype, torch.float32)
    padded = torch.zeros(blocks * block, dtype=dtype, device=x.device)
    padded[:n] = x
    rows = padded.view(blocks, block)
    scale = rows.abs().amax(dim=1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale is exact
    q = torch.round(rows / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.view(-1), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = QWZ_BLOCK) -> torch.Tensor:
    """q x scale, block by block (1-D, padded length)."""
    return (q.view(-1, block).to(scale.dtype) * scale[:, None]).view(-1)


class QuantizedGather:
    """Both all-gathers of one bucket; wait() finishes them, then dequantizes every rank's chunk into `out`."""

    def __init__(self, works: list, q_all: torch.Tensor, s_all: torch.Tensor, out: torch.Tensor, size: int,
                 block: int):
        self._works, self._args = works, (q_all, s_all, out, size, block)

    def wait(self) -> bool:
        for work in self._works:
            if work is not None:
                work.wait()
        self._works = []
        if self._args is not None:
            q_all, s_all, out, size, block = self._args
            self._args = None
            chunk = out.numel() // size
            full = dequantize_blocks(q_all, s_all, block).view(size, -1)[:, :chunk]
            out.view(size, chunk).copy_(full)
        return True


def quantized_all_gather(out: torch.Tensor, shard: torch.Tensor, group, size: int, *, block: int = QWZ_BLOCK,
                         ledger: CommLedger | None = None) -> QuantizedGather:
    """out = cat over the group's ranks of dequantize(quantize(shard)), launched asynchronously."""
    q, scale = quantize_blocks(shard, block)
    q_all = torch.empty(size * q.numel(), dtype=q.dtype, device=q.device)
    s_all = torch.empty(size * scale.numel(), dtype=scale.dtype, device=scale.device)
    works = [all_gather_flat(q_all, q, group, async_op=True, ledger=ledger, kind="all_gather_int8"),
             all_gather_flat(s_all, scale, group, async_op=True, ledger=ledger, kind="all_gather_scales")]
    return QuantizedGather(works, q_all, s_all, out, size, block)
