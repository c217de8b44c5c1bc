"""LoRA adapters (Hu et al. 2021) on the column- and row-parallel linear layers, split the way the base weight is.

    y = W x + (alpha / r) B A dropout(x)        W frozen; A (r, in) and B (out, r) trained

| base layer       | A (r, in)                   | B (out, r)                  | forward collective          | backward collective           |
|------------------|-----------------------------|-----------------------------|-----------------------------|-------------------------------|
| column-parallel  | replicated                  | split on out (W's rows)     | none                        | all-reduce of dA over tp      |
| row-parallel     | split on in (W's columns)   | replicated                  | joins the base's all-reduce | all-reduce of dB over tp      |

Why: a column-parallel layer's input is replicated, so A x is the same on every rank and B_r (this rank's output
rows, whole sections as W_r's) gives this rank's output slice with no communication. Its gradient
dA = sum_r B_r^T g_r x^T sums over the ranks: A goes through copy_to_tp_region (identity forward, all-reduce of its
gradient in backward), as models/attention.py's ReplicatedKV weight does. A row-parallel layer's input is split:
A_r x_r is a partial sum of A x, so B A_r x_r is a partial sum of B A x and is added to W_r x_r *before* the base
layer's one all-reduce (no extra collective in forward). B's gradient g (A x)^T needs the whole A x, and each rank
sees only its A_r x_r: B goes through copy_to_tp_region, whose backward all-reduce sums the parts. dA_r = B^T g x_r^T
is exact on each rank (g is the full, replicated output gradient). The input gradient needs nothing extra: the
column-parallel layer's copy_to_tp_region already all-reduces dx, and the row-parallel one's dx_r is local.

Dropout: a column-parallel adapter's input is replicated, so its mask must be too: the default stream, seeded the
same on every tp rank (like the residual dropout). A row-parallel adapter's input is this rank's slice: its own
mask, from the tp stream (TPRNGTracker.fork, replayed under activation checkpointing).

Sections: a fused column-parallel layer ([Q; K; V], [K; V], [gate; up]) is several projections in one weight.
An adapter covers some of its sections (`covers`): one adapter over all three of GPT-2's c_attn (PEFT's LoRA on
HF's fused Conv1D), or one per section (PEFT's on HF Llama's separate q_proj / k_proj / v_proj). B's rows are laid
out as W's: each covered section split over tp by whole rows of that section (ShardSpec sections).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.parallel.tensor.comms import copy_to_tp_region
from megazoo.parallel.tensor.shards import ShardSpec
from megazoo.parallel.topology import group_rank, group_size


class ColumnLoRA(nn.Module):
    """The adapter of a column-parallel layer over its sections `covers` (each `section_out` rows globally)."""

    def __init__(self, in_features: int, section_out: int, covers: tuple[int, ...], group, *, rank: int,
                 alpha: float, dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        tp, tp_rank = group_size(group), group_rank(group)
        if section_out % tp:
            raise ValueError(f"LoRA: {section_out} output rows per section are not divisible by tp = {tp}")
        self.group, self.covers, self.rank, self.scaling = group, tuple(covers), rank, alpha / rank
        self.init_std = 1.0 / rank  # A ~ N(0, 1/r), B = 0: the adapter starts as the identity (PEFT "gaussian")
        self.dropout = nn.Dropout(dropout)
        out = len(self.covers) * section_out
        self.shard_specs = {"lora_A": ShardSpec((rank, in_features)),
                            "lora_B": ShardSpec((out, rank), 0, len(self.covers), tp_rank, tp)}
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out // tp, rank, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x in the tp region (b, s, in) -> (b, s, covered out/tp)
        a = copy_to_tp_region(self.lora_A, self.group)  # backward: all-reduce of dA over tp
        return F.linear(F.linear(self.dropout(x), a), self.lora_B) * self.scaling


class RowLoRA(nn.Module):
    """The adapter of a row-parallel layer: A split on the input dim, B replicated; returns a partial sum."""

    def __init__(self, in_features: int, out_features: int, group, *, rank: int, alpha: float,
                 dropout: float = 0.0, rng=None, device=None, dtype=None):
        super().__init__()
        tp, tp_rank = group_size(group), group_rank(group)
        if in_features % tp:
            raise ValueError(f"LoRA: {in_features} input features are not divisible by tp = {tp}")
        self.group, self.rank, self.scaling, self.rng = group, rank, alpha / rank, rng
        self.init_std = 1.0 / rank
        self.dropout = nn.Dropout(dropout)
        self.shard_specs = {"lora_A": ShardSpec((rank, in_features), 1, 1, tp_rank, tp),
                            "lora_B": ShardSpec((out_features, rank))}
        self.lora_A = nn.Parameter(torch.empty(rank, in_features // tp, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (b, s, in/tp) -> partial (b, s, out), before all-reduce
        b = copy_to_tp_region(self.lora_B, self.group)  # backward: all-reduce of dB over tp
        split_mask = self.dropout.p > 0 and self.training and self.rng is not None
        with self.rng.fork() if split_mask else contextlib.nullcontext():  # this rank's slice: its own mask
            h = self.dropout(x)
        return F.linear(F.linear(h, self.lora_A), b) * self.scaling


def column_delta(adapters: nn.ModuleDict, x: torch.Tensor, sections: int, local_out: int) -> torch.Tensor:
    """The adapters' sum for a column-parallel layer's local output (b, s, local_out), section by section;
    sections no adapter covers get zeros."""
    per_section = local_out // sections
    pieces: list[torch.Tensor | None] = [None] * sections
    for adapter in adapters.values():
        for s, piece in zip(adapter.covers, adapter(x).split(per_section, dim=-1)):
            pieces[s] = piece if pieces[s] is None else pieces[s] + piece
    if len(pieces) == 1:
        return pieces[0]
    zeros = None
    for s, piece in enumerate(pieces):
        if piece is None:
            zeros = zeros if zeros is not None else x.new_zeros(*x.shape[:-1], per_section)
            pieces[s] = zeros
    return torch.cat(pieces, dim=-1)


def row_delta(adapters: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    """The adapters' partial sum for a row-parallel layer (added before its all-reduce)."""
    out = None
    for adapter in adapters.values():
        out = adapter(x) if out is None else out + adapter(x)
    return out


def is_lora_parameter(name: str) -> bool:
    """A LoRA adapter's parameter, by its global name ("h.0.attn.c_attn.lora.qkv.lora_A")."""
    return ".lora." in f".{name}"
