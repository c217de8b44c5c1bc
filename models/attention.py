"""Causal self-attention over this rank's heads: GPT-2's fused multi-head attention or grouped-query attention.

Multi-head (n_kv_head = n_head): one fused projection `c_attn`, column-parallel in 3 sections, rank r holding
[Q_r; K_r; V_r] for whole heads. Grouped-query (n_kv_head < n_head, Ainslie et al. 2023): `c_q` for the n_head
query heads and `c_kv` ([K; V], n_kv_head heads each); query head i uses key/value head i // (n_head / n_kv_head).
Under tensor parallelism (models/layout.py: kv_split):
- tp divides n_kv_head: c_kv is column-parallel in 2 sections; rank r's n_head / tp query heads use exactly its
  n_kv_head / tp key/value heads.
- tp a multiple of n_kv_head: every rank holds all of c_kv (replicated, as a norm weight) and projects only the
  one key/value head its query heads share. Its weight passes through copy_to_tp_region, so backward all-reduces
  the weight's gradient over tp (each rank's covers only its own head's rows): the replicated copies get the
  full, identical gradient.
Either way the input goes through one copy_to_tp_region (identity forward, all-reduce of dx in backward) shared by
the query and key/value projections, and c_proj is row-parallel (all-reduce in forward): the same collectives as
GPT-2's attention.

Rotary positions are applied to q and k after the projection, at the tokens' positions in the whole sequence
(the context-parallel chunks' own, past the decoding cache). A sliding window (Mistral) lets a query see the
`sliding_window` positions ending at itself. Shapes: b batch, s sequence, h local query heads, g local key/value
heads, hd head dim, d d_model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.kernels import Implementation, ModelOp, kernels_for_model
from megazoo.models.config import ModelConfig
from megazoo.models.generation.kv_cache import LayerCache
from megazoo.models.layout import check_parallel_compat, kv_split
from megazoo.models.norms import HeadRMSNorm
from megazoo.models.packing import Segments
from megazoo.models.rotary import apply_rotary, rotary_tables
from megazoo.models.sparse_attention import SparseAttention
from megazoo.parallel.context import context_attention, positions
from megazoo.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, SequenceParallel, TPRNGTracker,
                                    copy_to_tp_region)
from megazoo.parallel.tensor.sequence import plain
from megazoo.parallel.topology import Topology


def residual_std(cfg: ModelConfig) -> float:
    """GPT-2's scaled init of the projections that write into the residual stream: 0.02 / sqrt(2 n_layer)."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layer)


class ReplicatedKV(nn.Module):
    """[K; V] of all n_kv_head heads on every tp rank (tp a multiple of n_kv_head); `forward` projects one head.

    Same parameter name, global shape and initial values as the column-parallel c_kv of a tp that divides the
    heads (initialisation depends on name and global shape only), so checkpoints move between the two."""

    def __init__(self, cfg: ModelConfig, group, *, head: int, device=None, dtype=None):
        super().__init__()
        self.group, self.head, self.init_std = group, head, cfg.init_std
        self.n_kv_head, self.head_dim = cfg.n_kv_head, cfg.head_dim
        out = 2 * cfg.n_kv_head * cfg.head_dim
        self.weight = nn.Parameter(torch.empty(out, cfg.d_model, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out, device=device, dtype=dtype)) if cfg.qkv_bias else None

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's head's rows of [K; V] (and bias). Backward all-reduces the weight's (and bias's) gradient
        over tp: this rank's covers its head's rows only."""
        weight = copy_to_tp_region(self.weight, self.group).view(2, self.n_kv_head, self.head_dim, -1)
        weight = weight[:, self.head].reshape(2 * self.head_dim, -1)
        bias = None
        if self.bias is not None:
            bias = copy_to_tp_region(self.bias, self.group).view(2, self.n_kv_head, self.head_dim)
            bias = bias[:, self.head].reshape(-1)
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, d) -> [K_head; V_head] (b, s, 2 hd)
        return F.linear(x, *self.head_weights())


def sliding_window_attention(kernel, window: int):
    """(q, k, v, dropout_p) -> y: causal attention in which query i sees keys i - window + 1 .. i. Sequences no
    longer than the window are plain causal attention (the model's kernel)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        s = q.shape[2]
        if s <= window:
            return kernel(q, k, v, dropout_p)
        i = torch.arange(s, device=q.device)
        distance = i[:, None] - i[None, :]  # query - key
        mask = (distance >= 0) & (distance < window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

    return attend


def attention_ops(cfg: ModelConfig) -> tuple[ModelOp, ...]:
    """What Attention runs for `cfg`, for the run log's kernels: lines (models/transformer.py: model_ops)."""
    if cfg.attention == "sparse":
        return (ModelOp("attention", fixed=f"block-sparse {cfg.sparse_pattern!r} pattern (models/sparse_attention.py:"
                                           " FlexAttention on CUDA, gathered blocks elsewhere)"),)
    if cfg.sliding_window:
        return (ModelOp("attention", "attention"),
                ModelOp("sliding_window", fixed=f"SDPA under a {cfg.sliding_window}-token window mask for sequences "
                                                "longer than the window (shorter: the attention kernel above)"))
    return (ModelOp("attention", "attention"),)


class Attention(nn.Module):
    """Causal self-attention over this rank's n_head / tp query heads (and their key/value heads)."""

    def __init__(self, cfg: ModelConfig, topo: Topology, rng: TPRNGTracker, device=None, dtype=None, *,
                 kernels: Mapping[str, Implementation] | None = None,
                 sequence_parallel: SequenceParallel | None = None):
        super().__init__()
        check_parallel_compat(cfg, topo.tp)
        # x enters as this rank's s / tp positions under sequence parallelism (all-gathered into the projections)
        self.sequence_parallel = sequence_parallel if sequence_parallel is not None else plain(topo.tp_group)
        sp = self.sequence_parallel
        self.cfg, self.topo = cfg, topo
        self.n_local_heads = cfg.n_head // topo.tp  # from the shard, never from a global
        split = kv_split(cfg, topo.tp)
        self.n_local_kv = cfg.n_kv_head // topo.tp if split else 1
        self.head_dim = cfg.head_dim
        self.dropout = cfg.attn_dropout
        self.rng = rng
        # (q, k, v, dropout_p) -> y, causal: the dense kernel, or the block-sparse pattern of model.attention =
        # "sparse". cp > 1: q, k, v hold this rank's chunks of the sequence, and the kernel is wrapped in
        # all-to-all (Ulysses) or ring attention over the cp group (parallel/context).
        kernel = kernels_for_model(kernels)["attention"].fn if cfg.attention == "dense" else \
            SparseAttention.from_config(cfg, topo.device)
        if cfg.sliding_window:  # under cp only all-to-all (whole sequences in token order reach the kernel)
            if topo.cp > 1 and topo.cp_attention != "all_to_all":
                raise ValueError(f"model.sliding_window = {cfg.sliding_window} with parallel.cp_attention = "
                                 f"{topo.cp_attention!r} is not supported; valid: cp_attention = \"all_to_all\"")
            kernel = sliding_window_attention(kernel, cfg.sliding_window)
        self.attend = context_attention(kernel, topo.cp_group, topo.cp_attention)
        d, hd, group = cfg.d_model, cfg.head_dim, topo.tp_group
        if cfg.fused_qkv:
            # Fused QKV, column-parallel in 3 sections: rank r holds [Q_r; K_r; V_r] for whole heads.
            self.c_attn = ColumnParallelLinear(d, 3 * d, group, sections=3, bias=cfg.qkv_bias,
                                               init_std=cfg.init_std, device=device, dtype=dtype,
                                               sequence_parallel=sp)
        else:
            self.c_q = ColumnParallelLinear(d, cfg.n_head * hd, group, bias=cfg.qkv_bias, init_std=cfg.init_std,
                                            device=device, dtype=dtype)
            if split:  # rank r holds [K_r; V_r], its n_kv_head / tp heads
                self.c_kv = ColumnParallelLinear(d, 2 * cfg.n_kv_head * hd, group, sections=2, bias=cfg.qkv_bias,
                                                 init_std=cfg.init_std, device=device, dtype=dtype)
            else:  # the one head shared by this rank's query heads
                head = topo.tp_rank // (topo.tp // cfg.n_kv_head)
                self.c_kv = ReplicatedKV(cfg, group, head=head, device=device, dtype=dtype)
        self.c_proj = RowParallelLinear(cfg.n_head * hd, d, group, bias=cfg.proj_bias, init_std=residual_std(cfg),
                                        device=device, dtype=dtype, sequence_parallel=sp)
        if cfg.qk_norm:  # Qwen3: q and k RMS-normalised per head, before the rotary positions
            self.q_norm = HeadRMSNorm(hd, cfg.layer_norm_eps, group, device=device, dtype=dtype)
            self.k_norm = HeadRMSNorm(hd, cfg.layer_norm_eps, group, device=device, dtype=dtype)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (b, s, h hd), k and v (b, s, g hd)."""
        if self.cfg.fused_qkv:
            return self.c_attn(x).split(self.n_local_heads * self.head_dim, dim=-1)  # 3 x (b, s, d/tp)
        # x enters the tp region once for q and kv: one all-reduce of dx in backward (under sequence parallelism
        # one all-gather of x in forward, one more and a reduce-scatter of dx in backward)
        if self.c_q.lora is not None or getattr(self.c_kv, "lora", None) is not None or self.c_q.fp8 is not None:
            x = self.sequence_parallel.enter(x)  # (sequence parallel: the gathered x is kept for backward)
            q = self.c_q.local(x)  # (+ its LoRA adapters)
            kv = self.c_kv(x) if isinstance(self.c_kv, ReplicatedKV) else self.c_kv.local(x)
            return (q, *kv.split(self.n_local_kv * self.head_dim, dim=-1))
        kv = self.c_kv.head_weights() if isinstance(self.c_kv, ReplicatedKV) else (self.c_kv.weight, self.c_kv.bias)
        q, kv = self.sequence_parallel.linears(x, (self.c_q.weight, self.c_q.bias), kv)
        return (q, *kv.split(self.n_local_kv * self.head_dim, dim=-1))

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None,
                segments: Segments | None = None) -> torch.Tensor:  # (b, s, d) -> (b, s, d)
        """`segments` (packed rows, models/packing.py): positions restart and attention stays inside each one."""
        if segments is not None:
            self._check_segments(cache)
        q, k, v = self._project(x)  # sequence parallelism: x (b, s/tp, d), q k v over the whole s
        b, s = q.shape[:2]
        q = q.view(b, s, self.n_local_heads, self.head_dim)
        k = k.view(b, s, self.n_local_kv, self.head_dim)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)  # (b, h, s, hd)
        k, v = k.transpose(1, 2), v.view(b, s, self.n_local_kv, self.head_dim).transpose(1, 2)  # (b, g, s, hd)
        if self.cfg.positions == "rotary":
            if segments is not None:  # (b, s) positions -> (b, 1, s, hd) tables, broadcast over the heads
                cos, sin = (t[:, None] for t in rotary_tables(self.cfg, segments.positions, q.dtype))
            else:
                past = 0 if cache is None else cache.cache.length
                pos = past + positions(s, self.topo.cp, self.topo.cp_rank, x.device)
                cos, sin = rotary_tables(self.cfg, pos, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:  # decoding (models/generation/kv_cache.py): this rank's heads, past positions included
            k, v = cache.append(k, v)  # the cache holds the g key/value heads, not their repeats
            y = cache.attend(q, *self._repeat_kv(k, v), window=self.cfg.sliding_window)
            return self.c_proj(y.transpose(1, 2).reshape(b, s, self.n_local_heads * self.head_dim))
        k, v = self._repeat_kv(k, v)
        p = self.dropout if self.training else 0.0
        # Attention probabilities belong to this rank's heads only: their dropout draws from the tp stream.
        with self.rng.fork() if p > 0 else contextlib.nullcontext():
            if segments is not None:  # causal inside each packed example, no (s x s) mask (models/packing.py)
                y = segments.attend(q, k, v, p)
            else:
                y = self.attend(q, k, v, p)  # (b, h, s, hd)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, self.n_local_heads * self.head_dim))

    def _check_segments(self, cache: LayerCache | None) -> None:
        if cache is not None:
            raise ValueError("packed segments and a decoding cache cannot be combined: decode one example at a time")
        if self.topo.cp > 1:
            raise ValueError(f"packed sequences (segment ids) with parallel.cp = {self.topo.cp} are not supported "
                             "yet; valid: parallel.cp = 1, or sft.packing = false")
        if self.cfg.attention != "dense":
            raise ValueError(f"packed sequences need model.attention = 'dense', got {self.cfg.attention!r}; or set "
                             "sft.packing = false")

    def _repeat_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, g, s, hd) -> (b, h, s, hd): each key/value head repeated for the query heads that share it."""
        group = self.n_local_heads // self.n_local_kv
        if group == 1:
            return k, v
        return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
