"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3), over this rank's heads.

Per token x (d):
    c_q  = RMSNorm(x W_qa)                       q_lora_rank latent (no q compression, V2-Lite: q = x W_q)
    q    = c_q W_qb   -> per head [q_nope | q_pe]   qk_nope_head_dim + qk_rope_head_dim
    [c_kv; k_pe] = x W_kva                       kv_lora_rank latent and ONE rotary key shared by every head
    c_kv = RMSNorm(c_kv)
    [k_nope | v] = c_kv W_kvb  per head          qk_nope_head_dim and v_head_dim
    k    = [k_nope | rope(k_pe)],  q = [q_nope | rope(q_pe)]
    y    = softmax(q k^T * scale) v,  out = y W_o  scale: (nope + rope)^-1/2, YaRN's mscale^2 (deepseek/fields.py)

Tensor parallelism splits the heads: the down-projections (q_a, kv_a) and the latents' norms are replicated, the
up-projections (q_b or c_q, kv_b) column-parallel, c_proj row-parallel. The down-projections run on the tokens
this rank holds (under sequence parallelism its s / tp positions, their weights' gradients all-reduced over tp by
SequenceParallel.replicated); the normalised latents [c_q; c_kv; k_pe] then enter the tp region in ONE collective
(an all-gather of r + rope numbers per token under sequence parallelism, less than d; plain tp: the identity,
whose backward all-reduces the heads' partial gradients), so every replicated weight gets the full gradient.
Context parallelism: the shared rotary key is expanded with the heads' keys before the cp attention, so it travels
with them (all-to-all or ring, parallel/context), at the chunks' own positions.

The head widths differ (q, k: nope + rope; v: v_head_dim): the attention kernels take one width, so q, k and v are
zero-padded to the wider one (zeros add nothing to q.k, and v's padded columns are dropped) and q is pre-scaled
so the kernel's own 1 / sqrt(width) gives the latent attention's scale.

Decoding: with models/generation/kv_cache.py's KVCache the full per-head keys and values are cached (the
reference); with models/generation/latent_cache.py's LatentCache only c_kv and the rotated k_pe are, and the
up-projection is absorbed: q_nope W_uk attends over c_kv directly, and the output's latent is mapped by W_uv
(`_absorbed`). Shapes: b batch, s sequence, h local heads, r kv_lora_rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.kernels import Implementation, kernels_for_model
from megazoo.models.config import ModelConfig
from megazoo.models.deepseek.fields import mla_softmax_scale
from megazoo.models.generation.latent_cache import LatentLayerCache
from megazoo.models.layout import check_parallel_compat
from megazoo.models.norms import RMSNorm
from megazoo.models.rotary import apply_rotary, rotary_tables
from megazoo.parallel.context import context_attention, positions
from megazoo.parallel.tensor import ColumnParallelLinear, RowParallelLinear, SequenceParallel, TPRNGTracker
from megazoo.parallel.tensor.sequence import plain
from megazoo.parallel.topology import Topology

LATENT_NORM_EPS = 1e-6  # the latents' RMSNorm eps: DeepSeek's and transformers' (not rms_norm_eps)


class Replicated(nn.Module):
    """A bias-free linear layer's weight held whole on every tp rank (a down-projection)."""

    def __init__(self, out_features: int, in_features: int, init_std: float, device=None, dtype=None):
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))


def residual_std(cfg: ModelConfig) -> float:
    return cfg.init_std / math.sqrt(2 * cfg.n_layer)


class MLA(nn.Module):
    """Latent attention over this rank's n_head / tp heads (module docstring)."""

    def __init__(self, cfg: ModelConfig, topo: Topology, rng: TPRNGTracker, device=None, dtype=None, *,
                 kernels: Mapping[str, Implementation] | None = None,
                 sequence_parallel: SequenceParallel | None = None):
        super().__init__()
        check_parallel_compat(cfg, topo.tp)
        self.sequence_parallel = sequence_parallel if sequence_parallel is not None else plain(topo.tp_group)
        sp, group, std = self.sequence_parallel, topo.tp_group, cfg.init_std
        self.cfg, self.topo, self.rng, self.dropout = cfg, topo, rng, cfg.attn_dropout
        self.n_local_heads = cfg.n_head // topo.tp
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale = mla_softmax_scale(cfg)
        self.attend = context_attention(kernels_for_model(kernels)["attention"].fn, topo.cp_group, topo.cp_attention)
        d, n, r, qk = cfg.d_model, cfg.n_head, cfg.kv_lora_rank, self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a = Replicated(cfg.q_lora_rank, d, std, device, dtype)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, device, dtype, sequence_parallel=sp)
            self.q_b = ColumnParallelLinear(cfg.q_lora_rank, n * qk, group, bias=False, init_std=std, device=device,
                                            dtype=dtype)
        else:
            self.c_q = ColumnParallelLinear(d, n * qk, group, bias=False, init_std=std, device=device, dtype=dtype,
                                            sequence_parallel=sp)
        self.kv_a = Replicated(r + self.rope, d, std, device, dtype)
        self.kv_a_norm = RMSNorm(r, LATENT_NORM_EPS, device, dtype, sequence_parallel=sp)
        self.kv_b = ColumnParallelLinear(r, n * (self.nope + self.v_dim), group, bias=False, init_std=std,
                                         device=device, dtype=dtype)
        self.c_proj = RowParallelLinear(n * self.v_dim, d, group, bias=False, init_std=residual_std(cfg),
                                        device=device, dtype=dtype, sequence_parallel=sp)

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (b, s, h (nope + rope)), c_kv (b, s, r) normalised, k_pe (b, s, rope) before its rotation; s the whole
        sequence (under sequence parallelism x holds s / tp positions)."""
        sp, cfg = self.sequence_parallel, self.cfg
        r = cfg.kv_lora_rank
        if cfg.q_lora_rank:
            # two matmuls, not one over the concatenated weights: that concatenation would be a weight-sized
            # tensor kept for backward in every layer
            c_q = F.linear(x, sp.replicated(self.q_a.weight))
            c_kv, k_pe = F.linear(x, sp.replicated(self.kv_a.weight)).split([r, self.rope], dim=-1)
            latents = sp.enter(torch.cat([self.q_a_norm(c_q), self.kv_a_norm(c_kv), k_pe], dim=-1))
            c_q, c_kv, k_pe = latents.split([cfg.q_lora_rank, r, self.rope], dim=-1)
            return self.q_b.local(c_q), c_kv, k_pe
        q = self.c_q(x)  # its own entry into the tp region
        c_kv, k_pe = F.linear(x, sp.replicated(self.kv_a.weight)).split([r, self.rope], dim=-1)
        c_kv, k_pe = sp.enter(torch.cat([self.kv_a_norm(c_kv), k_pe], dim=-1)).split([r, self.rope], dim=-1)
        return q, c_kv, k_pe

    def forward(self, x: torch.Tensor, cache=None, segments=None) -> torch.Tensor:  # (b, s, d) -> (b, s, d)
        """`segments` (packed rows, models/packing.py): the rotary positions restart at each example and attention
        stays inside it, as in models/attention.py."""
        if segments is not None and (cache is not None or self.topo.cp > 1):
            raise ValueError("packed sequences (segment ids) with latent attention take neither a decoding cache nor "
                             f"context parallelism (parallel.cp = {self.topo.cp}); valid: one example at a time "
                             "when decoding, parallel.cp = 1 with sft.packing")
        q, c_kv, k_pe = self._latents(x)
        b, s = q.shape[:2]
        h = self.n_local_heads
        q_nope, q_pe = q.view(b, s, h, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        if segments is not None:  # (b, s) positions -> (b, 1, s, rope) tables, broadcast over the heads
            cos, sin = (t[:, None] for t in rotary_tables(self.cfg, segments.positions, q.dtype))
        else:
            past = 0 if cache is None else cache.cache.length
            cos, sin = rotary_tables(self.cfg, past + positions(s, self.topo.cp, self.topo.cp_rank, x.device),
                                     q.dtype)
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe[:, None], cos, sin)  # k_pe (b, 1, s, rope)
        if isinstance(cache, LatentLayerCache):
            return self._absorbed(q_nope, q_pe, c_kv, k_pe[:, 0], cache)
        kv = self.kv_b.local(c_kv).view(b, s, h, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, h, -1, -1)], dim=-1)
        q, k, v = self._padded(q, k, v)
        if cache is not None:  # the full-cache reference: every head's (padded) keys and values
            k, v = cache.append(k, v)
            y = cache.attend(q, k, v)
        else:
            p = self.dropout if self.training else 0.0
            with self.rng.fork() if p > 0 else contextlib.nullcontext():  # this rank's heads: the tp stream
                y = self.attend(q, k, v, p) if segments is None else segments.attend(q, k, v, p)
        return self.c_proj(y[..., :self.v_dim].transpose(1, 2).reshape(b, s, h * self.v_dim))

    def _padded(self, q, k, v):
        """q, k, v zero-padded to one width D, q times scale * sqrt(D) (the kernels' scale is 1 / sqrt(D))."""
        width = max(q.shape[-1], v.shape[-1])
        q = q * (self.scale * math.sqrt(width))
        if q.shape[-1] < width:
            q, k = F.pad(q, (0, width - q.shape[-1])), F.pad(k, (0, width - k.shape[-1]))
        if v.shape[-1] < width:
            v = F.pad(v, (0, width - v.shape[-1]))
        return q, k, v

    def _absorbed(self, q_nope, q_pe, c_kv, k_pe, cache: LatentLayerCache) -> torch.Tensor:
        """Decoding over the latent cache: scores = (q_nope W_uk) c_kv^T + q_pe k_pe^T, y = (p c_kv) W_uv^T."""
        b, h, s = q_nope.shape[:3]
        w = self.kv_b.weight
        for adapter in (self.kv_b.lora or {}).values():  # an unmerged LoRA adapter on kv_b (target kv): W + s B A
            w = w + adapter.scaling * adapter.lora_B @ adapter.lora_A
        w = w.view(h, self.nope + self.v_dim, self.cfg.kv_lora_rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # (h, nope, r), (h, v, r)
        c_kv, k_pe = cache.append(c_kv, k_pe)  # (b, past + s, r), (b, past + s, rope)
        q_latent = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)
        scores = (q_latent @ c_kv[:, None].transpose(-1, -2) + q_pe @ k_pe[:, None].transpose(-1, -2)) * self.scale
        probs = torch.softmax(scores + cache.mask(s, c_kv.shape[1], scores), dim=-1)
        y = torch.einsum("bhsr,hvr->bshv", probs @ c_kv[:, None], w_uv)
        return self.c_proj(y.reshape(b, s, h * self.v_dim))
