"""The GPT-style decoder shared by every preset, built on tensor-parallel layers.

Pre-LayerNorm blocks, learned positions, tanh-GELU MLP, input and output embeddings tied. Parameter names follow
Hugging Face GPT-2 (`wte`, `wpe`, `h.<i>.ln_1`, `h.<i>.attn.c_attn`, `h.<i>.attn.c_proj`, `h.<i>.ln_2`,
`h.<i>.mlp.c_fc`, `h.<i>.mlp.c_proj`, `ln_f`), so import/export is a transpose table.

Pipeline-friendly by construction: blocks live in a ModuleDict keyed by their *global* index, the embedding and
the head are optional, and forward is a plain loop, so a pipeline stage builds only its own part.

Fused kernels: LayerNorm, bias + GELU, the attention core and the cross-entropy run the implementations in
`kernels` (kernels/dispatch.py: resolve_kernels). Without it the model runs torch's LayerNorm, GELU and SDPA
and the reference vocab-parallel cross-entropy, exactly as before the dispatch existed.

Shapes in comments: b batch, s sequence, d d_model, tp tensor-parallel size, V padded vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megazoo.kernels import Implementation, KernelChoice, LayerNorm, kernels_for_model
from megazoo.models.config import ModelConfig
from megazoo.models.kv_cache import KVCache, LayerCache
from megazoo.models.layout import check_parallel_compat
from megazoo.models.sparse_attention import SparseAttention
from megazoo.parallel.context import all_reduce_count, context_attention, positions
from megazoo.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, TPRNGTracker, VocabParallelEmbedding,
                             copy_to_tp_region)
from megazoo.parallel.topology import Topology


class Attention(nn.Module):
    """Causal self-attention over this rank's n_head / tp heads."""

    def __init__(self, cfg: ModelConfig, topo: Topology, rng: TPRNGTracker, device=None, dtype=None, *,
                 kernels: Mapping[str, Implementation] | None = None):
        super().__init__()
        check_parallel_compat(cfg, topo.tp)
        self.n_local_heads = cfg.n_head // topo.tp  # from the shard, never from a global
        self.head_dim = cfg.head_dim
        self.dropout = cfg.attn_dropout
        self.rng = rng
        # (q, k, v, dropout_p) -> y, causal: the dense kernel, or the block-sparse pattern of model.attention =
        # "sparse". cp > 1: q, k, v hold this rank's chunks of the sequence, and the kernel is wrapped in
        # all-to-all (Ulysses) or ring attention over the cp group (parallel/context).
        kernel = kernels_for_model(kernels)["attention"].fn if cfg.attention == "dense" else \
            SparseAttention.from_config(cfg, topo.device)
        self.attend = context_attention(kernel, topo.cp_group, topo.cp_attention)
        d, group = cfg.d_model, topo.tp_group
        # Fused QKV, column-parallel in 3 sections: rank r holds [Q_r; K_r; V_r] for whole heads.
        self.c_attn = ColumnParallelLinear(d, 3 * d, group, sections=3, init_std=cfg.init_std,
                                           device=device, dtype=dtype)
        self.c_proj = RowParallelLinear(d, d, group, init_std=residual_std(cfg), device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:  # (b, s, d) -> (b, s, d)
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).split(self.n_local_heads * self.head_dim, dim=-1)  # 3 x (b, s, d/tp)
        q, k, v = (t.view(b, s, self.n_local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if cache is not None:  # decoding (models/kv_cache.py): this rank's heads, past positions included
            y = cache.attend(q, *cache.append(k, v))
            return self.c_proj(y.transpose(1, 2).reshape(b, s, self.n_local_heads * self.head_dim))
        p = self.dropout if self.training else 0.0
        # Attention probabilities belong to this rank's heads only: their dropout draws from the tp stream.
        with self.rng.fork() if p > 0 else contextlib.nullcontext():
            y = self.attend(q, k, v, p)  # (b, h/tp, s, hd)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, self.n_local_heads * self.head_dim))


class MLP(nn.Module):
    """d -> d_ff column-parallel, tanh-GELU on the local slice, d_ff -> d row-parallel (one all-reduce)."""

    def __init__(self, cfg: ModelConfig, topo: Topology, device=None, dtype=None, *,
                 kernels: Mapping[str, Implementation] | None = None):
        super().__init__()
        bias_gelu = kernels_for_model(kernels)["bias_gelu"]
        # torch: cuBLAS / MKL add c_fc's bias inside the GEMM (addmm) for free, then torch's GELU kernel. The fused
        # kernels instead take the bias: c_fc runs its matmul only (same parameters, names and shapes).
        self.bias_gelu = None if bias_gelu.name == "torch" else bias_gelu.fn
        self.c_fc = ColumnParallelLinear(cfg.d_model, cfg.d_ff, topo.tp_group, init_std=cfg.init_std,
                                         device=device, dtype=dtype)
        self.c_proj = RowParallelLinear(cfg.d_ff, cfg.d_model, topo.tp_group, init_std=residual_std(cfg),
                                        device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias_gelu is None:
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        assert not self.c_fc.gather_output  # the local slice (b, s, d_ff/tp), as ColumnParallelLinear.forward
        h = F.linear(copy_to_tp_region(x, self.c_fc.group), self.c_fc.weight)
        return self.c_proj(self.bias_gelu(h, self.c_fc.bias))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, topo: Topology, rng: TPRNGTracker, device=None, dtype=None, *,
                 kernels: Mapping[str, Implementation] | None = None):
        super().__init__()
        kernels = kernels_for_model(kernels)
        ln = kernels["layer_norm"].fn
        self.ln_1 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, fn=ln, device=device, dtype=dtype)
        self.attn = Attention(cfg, topo, rng, device=device, dtype=dtype, kernels=kernels)
        self.ln_2 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, fn=ln, device=device, dtype=dtype)
        self.mlp = MLP(cfg, topo, device=device, dtype=dtype, kernels=kernels)
        self.dropout = nn.Dropout(cfg.dropout)  # residual stream is replicated: default stream

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x)) if cache is None else self.attn(self.ln_1(x), cache))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """A decoder stage: optional embedding, blocks `layers` (global indices), optional final LN + tied head.

    With the head, forward returns this rank's vocabulary shard of the logits, (b, s, V/tp); without it, the
    hidden states (b, s, d). Parameters are allocated uninitialised on `device` (use init_weights, or
    device="meta" to count without allocating). `kernels`: resolved implementations ({op: Implementation},
    ops not given keep the defaults) or a KernelChoice to resolve for topo.device; None: the defaults.
    """

    def __init__(self, cfg: ModelConfig, topo: Topology, *, layers: range | None = None,
                 with_embedding: bool = True, with_head: bool = True, rng: TPRNGTracker | None = None,
                 activation_checkpointing: bool = False, device=None, dtype=torch.float32,
                 kernels: KernelChoice | Mapping[str, Implementation] | None = None):
        super().__init__()
        self.cfg, self.topo = cfg, topo
        self.kernels = kernels_for_model(kernels, topo.device)  # {op: Implementation}, .describe() for the log
        self.layers = range(cfg.n_layer) if layers is None else layers
        self.with_embedding, self.with_head = with_embedding, with_head
        self.activation_checkpointing = activation_checkpointing
        self.rng = rng if rng is not None else TPRNGTracker(0, topo.tp_rank, topo.device)
        self.vocab_padded = cfg.padded_vocab(topo.tp)
        if with_embedding or with_head:  # the head reuses wte (tied)
            self.wte = VocabParallelEmbedding(self.vocab_padded, cfg.d_model, topo.tp_group,
                                              init_std=cfg.init_std, device=device, dtype=dtype,
                                              tied_head=with_embedding and with_head)
        if with_embedding:
            self.wpe = nn.Embedding(cfg.n_positions, cfg.d_model, device=device, dtype=dtype)
            self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleDict({str(i): Block(cfg, topo, self.rng, device=device, dtype=dtype, kernels=self.kernels)
                                for i in self.layers})
        if with_head:
            self.ln_f = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, fn=self.kernels["layer_norm"].fn,
                                  device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """`cache` (decoding, eval mode): x holds only the new positions, which follow the cached ones."""
        past = 0 if cache is None else cache.length
        if self.with_embedding:  # x: token ids (b, s)
            s = x.shape[1]
            if past + s * self.topo.cp > self.cfg.n_positions:  # cp > 1: x holds this rank's chunks of the sequence
                raise ValueError(f"sequence length {past + s * self.topo.cp} exceeds model.n_positions = "
                                 f"{self.cfg.n_positions}")
            pos = past + positions(s, self.topo.cp, self.topo.cp_rank, x.device)  # the chunks' own positions
            x = self.drop(self.wte(x) + self.wpe(pos))  # (b, s, d)
        if cache is not None:
            cache.check_room(x.shape[1])
            for i, block in self.h.items():
                x = block(x, cache.layer(int(i)))
            cache.advance(x.shape[1])
        elif self.activation_checkpointing and self.training:
            for block in self.h.values():
                x = checkpoint(self.rng.replayable(block), x, use_reentrant=False)
        else:
            for block in self.h.values():
                x = block(x)
        if not self.with_head:
            return x
        x = self.ln_f(x)
        return self.wte.head(x)  # tied head: logits for this rank's vocab shard (b, s, V/tp)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over non-ignored targets, from vocab-sharded logits.

        cp > 1: the mean is over the whole sequences (tokens counted over the cp group), and this rank's sum is
        scaled by cp: gradients are averaged over dp x cp, so the cp ranks' mean is the unsplit sequence's loss."""
        per_token = self.kernels["cross_entropy"].fn(logits, targets, self.topo.tp_group, self.cfg.vocab_size)
        count = all_reduce_count((targets != -100).sum(), self.topo.cp_group)
        return per_token.sum() * self.topo.cp / count.clamp(min=1)


def residual_std(cfg: ModelConfig) -> float:
    """GPT-2's scaled init of the projections that write into the residual stream: 0.02 / sqrt(2 n_layer)."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layer)
