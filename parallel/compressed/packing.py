"""Sign bits packed 8 per byte, plus one scale per chunk: the wire format of the compressed all-reduce.

A chunk x of c elements (c a multiple of 8) is sent as c / 8 bytes of signs (bit 1: x >= 0, so 0 counts as
positive; the most significant bit is the first element) followed by its scale, ||x||_2 / sqrt(c) in x's dtype
(the element_size bytes of that number). Decompressed, the chunk is scale * sign(x): same L2 norm as x.
Everything here is a torch op, so it runs where the tensor lives (CPU or GPU) without a host read.
"""

from __future__ import annotations

import math

import torch

_SIGN_TABLES: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _sign_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 8): row b holds the 8 signs (+1 / -1) byte b packs. Unpacking is one index_select into it (a
    broadcast bitwise test and torch.where are several times slower on the CPU)."""
    key = (str(device), dtype)
    if key not in _SIGN_TABLES:
        shifts = torch.arange(7, -1, -1, device=device)
        bits = torch.bitwise_right_shift(torch.arange(256, device=device).unsqueeze(1), shifts) & 1
        _SIGN_TABLES[key] = (bits * 2 - 1).to(dtype)
    return _SIGN_TABLES[key]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """(..., n) bool -> (..., n / 8) uint8, the first element in the most significant bit. n: a multiple of 8."""
    if mask.shape[-1] % 8:
        raise ValueError(f"sign packing needs a last dim that is a multiple of 8, got {tuple(mask.shape)}")
    bits = mask.to(torch.uint8).view(*mask.shape[:-1], mask.shape[-1] // 8, 8)
    packed = bits[..., 0] << 7
    for i in range(1, 8):
        packed |= bits[..., i] << (7 - i)
    return packed


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., m) uint8 -> (..., 8 m) of +1 / -1 in `dtype`: the inverse of pack_signs."""
    table = _sign_table(packed.device, dtype)
    return table.index_select(0, packed.reshape(-1).int()).view(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """(..., n) float -> (..., n / 8) uint8; bit set where x >= 0 (0 counts as positive: one bit has no zero)."""
    return pack_bits(x >= 0)


def chunk_scales(x: torch.Tensor) -> torch.Tensor:
    """(k, c) -> (k, 1): each row's RMS, ||row||_2 / sqrt(c), so scale * sign(row) keeps the row's norm."""
    return (torch.linalg.vector_norm(x, dim=1, keepdim=True) / math.sqrt(x.shape[1])).to(x.dtype)


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, c) -> (wire (k, c / 8 + element_size) uint8, decompressed (k, c)): each row's signs and scale as
    bytes, and what the receiver will reconstruct from them, sign x scale (the sender's error feedback needs it;
    computed from the packed bytes, exactly as the receiver does)."""
    packed, scales = pack_signs(x), chunk_scales(x)
    wire = torch.cat([packed, scales.view(torch.uint8)], dim=1)
    return wire, unpack_signs(packed, x.dtype).mul_(scales)


def decode(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(k, c / 8 + element_size) uint8 -> (k, c) in `dtype`: each row's sign x scale."""
    size = torch.empty((), dtype=dtype).element_size()
    # a fresh, aligned copy (one row's slice counts as contiguous, so .contiguous() would keep its odd offset)
    scales = wire[:, -size:].reshape(-1).clone().view(dtype).view(-1, 1)
    return unpack_signs(wire[:, :-size], dtype).mul_(scales)


def wire_bytes(c: int, dtype: torch.dtype) -> int:
    """Bytes of one encoded chunk of c elements."""
    return c // 8 + torch.empty((), dtype=dtype).element_size()
