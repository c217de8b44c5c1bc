"""Packed sequences: several examples in one row, each seeing only itself (data/sft/packing.py builds the rows).

Per-token segment ids (b, s) (1, 2, ... per example, 0 for padding; equal ids are contiguous) become, once per
forward, what every layer needs:
- positions (b, s): restarting at 0 at each segment's first token, for the learned position embedding and the
  rotary tables, so an example's tokens get the positions they would get alone;
- runs: each maximal run of equal ids as (row, start, end), and the same as cumulative offsets into the b x s
  tokens (`cu_seqlens`, the layout of variable-length attention kernels).

`attend` computes causal attention inside each run (the sliding window, when the model has one, too) without
an (s x s) mask: a packed row costs the attention memory of its examples padded to their own lengths, never
more than one unpacked row of s tokens. On CUDA in fp16 / bf16 without attention dropout: one call of torch's
variable-length FlashAttention (torch.nn.attention.varlen) over every run of the micro-batch. Elsewhere (the
CPU, fp32 / fp64, dropout): torch's scaled_dot_product_attention, causal, once per run (its fused CPU kernel
stores no scores). Padding (segment 0) attends to the padding of its own run only, so no query row is empty.

`dense_mask()` is the (b, 1, s, s) block-diagonal causal mask the attention used to take (True = may attend):
the reference the variable-length path is tested against (tests/models/test_packed_attention.py), built only
when asked for. Context parallelism, block-sparse attention and the decoding cache do not take segments (their
errors say so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # torch's variable-length FlashAttention (CUDA, fp16 / bf16)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: the per-run path everywhere
    varlen_attn = None


@dataclass(frozen=True)
class Segments:
    positions: torch.Tensor  # (b, s) int64: each token's position within its own example
    ids: torch.Tensor  # (b, s) the segment ids themselves
    runs: tuple[tuple[int, int, int], ...]  # (row, start, end) of each maximal run of equal ids, in token order
    cu_seqlens: torch.Tensor  # (len(runs) + 1,) int32: the runs' starts in the flattened b x s tokens, then b s
    max_len: int  # the longest run
    sliding_window: int = 0  # a query sees the `sliding_window` positions ending at itself (0: all earlier ones)

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
        # One host read per forward: the run boundaries (every kernel below needs them as integers).
        flat_starts = starts.reshape(-1).nonzero().view(-1).tolist() + [b * s]
        runs = tuple((a // s, a % s, a % s + (e - a)) for a, e in zip(flat_starts[:-1], flat_starts[1:]))
        cu = torch.tensor(flat_starts, dtype=torch.int32, device=segment_ids.device)
        return cls(positions=index - first, ids=segment_ids, runs=runs, cu_seqlens=cu,
                   max_len=max(e - a for _, a, e in runs), sliding_window=sliding_window)

    def dense_mask(self) -> torch.Tensor:
        """(b, 1, s, s) bool, True = query i may attend key j: causal AND same segment (AND inside the window)."""
        s = self.ids.shape[1]
        index = torch.arange(s, device=self.ids.device)
        same = self.ids[:, :, None] == self.ids[:, None, :]
        distance = index[:, None] - index[None, :]  # query - key
        allowed = distance >= 0
        if self.sliding_window:
            allowed = allowed & (distance < self.sliding_window)
        return (same & allowed)[:, None]

    # Not traced by torch.compile (train.compile = "blocks"): the runs are Python integers that differ from one
    # micro-batch to the next, and a compiled block would be specialised on them and recompiled for every new
    # packing; kept out of the graph, the block compiles once and this runs eagerly (one fused kernel on CUDA).
    @torch.compiler.disable
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        """(b, h, s, hd) q, k, v (k, v with as many heads as q) -> (b, h, s, hd): causal attention inside runs."""
        b, h, s, hd = q.shape
        if varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0:
            flat = [t.transpose(1, 2).reshape(b * s, h, hd) for t in (q, k, v)]  # (tokens, heads, hd)
            # flash's window counts the keys left of the query: ours includes the query itself
            window = (self.sliding_window - 1, 0) if self.sliding_window else (-1, 0)
            y = varlen_attn(*flat, self.cu_seqlens, self.cu_seqlens, self.max_len, self.max_len, window_size=window)
            return y.view(b, s, h, hd).transpose(1, 2)
        rows: list[list[torch.Tensor]] = [[] for _ in range(b)]
        for row, start, end in self.runs:
            part = [t[row:row + 1, :, start:end] for t in (q, k, v)]
            rows[row].append(_causal(*part, dropout_p, self.sliding_window))
        return torch.cat([torch.cat(parts, dim=2) for parts in rows], dim=0)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, window: int) -> torch.Tensor:
    """Causal attention over one run (1, h, n, hd); inside a sliding window when the run is longer than it."""
    n = q.shape[2]
    if not window or n <= window:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    i = torch.arange(n, device=q.device)
    distance = i[:, None] - i[None, :]  # the band of one run: n x n, at most the run's own length squared
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(distance >= 0) & (distance < window),
                                          dropout_p=dropout_p)
