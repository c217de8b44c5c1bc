"""Packed sequences: several examples in one row, each seeing only itself (data/sft/packing.py builds the rows).

Per-token segment ids (b, s) (1, 2, ... per example, 0 for padding; equal ids are contiguous) become, once per
forward, what every layer needs:
- positions (b, s): restarting at 0 at each segment's first token, for the learned position embedding and the
  rotary tables, so an example's tokens get the positions they would get alone;
- mask (b, 1, s, s) bool, True = may attend: causal AND same segment (block-diagonal), narrowed to the sliding
  window when the model has one. Padding (segment 0) attends to earlier padding only, so no query row is empty.

The attention core then runs torch's scaled_dot_product_attention with this boolean mask (models/attention.py)
instead of the causal kernel: the fused kernels of kernels/ take no mask. Context parallelism, block-sparse
attention and the decoding cache do not take segments (their errors say so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    positions: torch.Tensor  # (b, s) int64: each token's position within its own example
    mask: torch.Tensor  # (b, 1, s, s) bool: query i may attend key j

    @classmethod
    def from_ids(cls, segment_ids: torch.Tensor, sliding_window: int = 0) -> "Segments":
        if segment_ids.dim() != 2:
            raise ValueError(f"segment ids must be (batch, sequence), got shape {tuple(segment_ids.shape)}")
        b, s = segment_ids.shape
        index = torch.arange(s, device=segment_ids.device).expand(b, s)
        starts = torch.ones_like(segment_ids, dtype=torch.bool)
        starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
        # The index of each token's segment start: the running maximum of the start indices seen so far.
        first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (b, s, s)
        distance = index[0][:, None] - index[0][None, :]  # query - key
        allowed = distance >= 0
        if sliding_window:
            allowed = allowed & (distance < sliding_window)
        return cls(positions=index - first, mask=(same & allowed)[:, None])
