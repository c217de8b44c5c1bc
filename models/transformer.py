"""The GPT-style decoder shared by every preset, built on tensor-parallel layers.

Pre-norm blocks whose architecture follows the config (models/config.py): GPT-2's LayerNorm, learned positions,
tanh-GELU MLP and tied embeddings by default; RMSNorm (models/norms.py), rotary positions (models/rotary.py),
SwiGLU (models/mlp.py), grouped-query attention and sliding windows (models/attention.py) and an untied
`lm_head` for the Llama-style families. Parameter names follow Hugging Face GPT-2 (`wte`, `wpe`, `h.<i>.ln_1`,
`h.<i>.attn.c_attn`, `h.<i>.attn.c_proj`, `h.<i>.ln_2`, `h.<i>.mlp.c_fc`, `h.<i>.mlp.c_proj`, `ln_f`), so GPT-2
import/export is a transpose table; the Llama-style names (`attn.c_q`, `attn.c_kv`, `lm_head`) map onto HF
Llama's through models/hf/llama.py. models/layout.py lists them all.

Pipeline-friendly by construction: blocks live in a ModuleDict keyed by their *global* index, the embedding and
the head are optional, and forward is a plain loop, so a pipeline stage builds only its own part.

Fused kernels: LayerNorm, bias + GELU, the attention core and the cross-entropy run the implementations in
`kernels` (kernels/dispatch.py: resolve_kernels). Without it the model runs torch's LayerNorm, GELU and SDPA
and the reference vocab-parallel cross-entropy, exactly as before the dispatch existed.

Shapes in comments: b batch, s sequence, d d_model, tp tensor-parallel size, V padded vocabulary.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megazoo.kernels import Implementation, KernelChoice, ModelOp, kernels_for_model
from megazoo.models.attention import Attention, attention_ops
from megazoo.models.config import ModelConfig
from megazoo.models.deepseek.mla import MLA
from megazoo.models.deepseek.mtp import MTP, mtp_targets
from megazoo.models.generation.kv_cache import KVCache, LayerCache
from megazoo.models.mlp import make_mlp, mlp_ops
from megazoo.models.moe import MoE, RouterStats, load_balancing_loss, z_loss
from megazoo.models.norms import make_norm, norm_ops
from megazoo.models.packing import Segments
from megazoo.parallel.context import all_reduce_count, positions
from megazoo.parallel.tensor import ColumnParallelLinear, SequenceParallel, TPRNGTracker, VocabParallelEmbedding
from megazoo.parallel.tensor.linear_cross_entropy import linear_cross_entropy
from megazoo.parallel.tensor.sequence import plain
from megazoo.parallel.topology import Topology


def model_ops(cfg: ModelConfig) -> tuple[ModelOp, ...]:
    """Every op this config's model (and its optimizer) runs, each stated by the factory that builds it (norms,
    attention, MLP): the run log's kernels: lines (kernels/dispatch.py: describe_ops). A Llama-style model names
    its RMSNorm and SwiGLU, not GPT-2's LayerNorm and bias-GELU."""
    return (*norm_ops(cfg), *attention_ops(cfg), *mlp_ops(cfg), ModelOp("cross_entropy", "cross_entropy"),
            ModelOp("adamw", "adamw"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, topo: Topology, rng: TPRNGTracker, device=None, dtype=None, *,
                 kernels: Mapping[str, Implementation] | None = None,
                 sequence_parallel: SequenceParallel | None = None, index: int = 0):
        super().__init__()
        kernels = kernels_for_model(kernels)
        sp = sequence_parallel if sequence_parallel is not None else plain(topo.tp_group)
        self.sequence_parallel, self.rng = sp, rng
        self.ln_1 = make_norm(cfg, kernels, device=device, dtype=dtype, sequence_parallel=sp)
        attention = MLA if cfg.mla else Attention  # latent attention (models/deepseek/mla.py) or MHA / GQA
        self.attn = attention(cfg, topo, rng, device=device, dtype=dtype, kernels=kernels, sequence_parallel=sp)
        self.ln_2 = make_norm(cfg, kernels, device=device, dtype=dtype, sequence_parallel=sp)
        if cfg.moe_layer(index):  # the MoE block in place of the dense MLP (models/moe/)
            self.mlp = MoE(cfg, topo, device=device, dtype=dtype, sequence_parallel=sp)
        else:
            self.mlp = make_mlp(cfg, topo, device=device, dtype=dtype, kernels=kernels, sequence_parallel=sp)
        self.dropout = nn.Dropout(cfg.dropout)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # The residual stream is replicated over tp (default stream: the same mask on every rank), or, under
        # sequence parallelism, this rank's own positions (the tp stream: each rank its own mask, as Megatron).
        if not (self.sequence_parallel.active and self.training and self.dropout.p > 0):
            return self.dropout(x)
        with self.rng.fork():
            return self.dropout(x)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None,
                segments: Segments | None = None) -> torch.Tensor:
        if segments is not None:
            x = x + self._drop(self.attn(self.ln_1(x), segments=segments))
        else:
            x = x + self._drop(self.attn(self.ln_1(x)) if cache is None else self.attn(self.ln_1(x), cache))
        return x + self._drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """A decoder stage: optional embedding, blocks `layers` (global indices), optional final norm + head (tied to
    the embedding, or its own `lm_head` when model.tie_embeddings is false).

    With the head, forward returns this rank's vocabulary shard of the logits, (b, s, V/tp); without it, the
    hidden states (b, s, d). Parameters are allocated uninitialised on `device` (use init_weights, or
    device="meta" to count without allocating). `kernels`: resolved implementations ({op: Implementation},
    ops not given keep the defaults) or a KernelChoice to resolve for topo.device; None: the defaults.
    """

    def __init__(self, cfg: ModelConfig, topo: Topology, *, layers: range | None = None,
                 with_embedding: bool = True, with_head: bool = True, rng: TPRNGTracker | None = None,
                 activation_checkpointing: bool = False, device=None, dtype=torch.float32,
                 kernels: KernelChoice | Mapping[str, Implementation] | None = None, fused_loss: bool = False):
        super().__init__()
        self.cfg, self.topo = cfg, topo
        # fused_loss: a forward with gradients returns the final norm's output and `loss` runs the head and the
        # cross-entropy together (parallel/tensor/linear_cross_entropy.py); decoding and no-grad forwards
        # return logits as always. `_hidden` is that forward's output, so `loss` knows which it was given.
        self.fused_loss, self._hidden = fused_loss, None
        self.loss_chunk_rows: int | None = None  # tokens per chunk of the fused loss (None: linear_cross_entropy's)
        self.kernels = kernels_for_model(kernels, topo.device)  # {op: Implementation}, .describe() for the log
        self.layers = range(cfg.n_layer) if layers is None else layers
        self.with_embedding, self.with_head = with_embedding, with_head
        self.activation_checkpointing = activation_checkpointing
        self.rng = rng if rng is not None else TPRNGTracker(0, topo.tp_rank, topo.device)
        # one set of region boundaries for every layer: sequence-parallel (topo.sequence_parallel) or plain tp
        self.sequence_parallel = SequenceParallel(topo.tp_group, topo.sequence_parallel)
        sp = self.sequence_parallel
        self.vocab_padded = cfg.padded_vocab(topo.tp)
        tied = cfg.tie_embeddings
        # a tied head reuses wte; so does multi-token prediction (its next-token embeddings), on the last stage
        if with_embedding or (with_head and (tied or cfg.mtp_depth)):
            self.wte = VocabParallelEmbedding(self.vocab_padded, cfg.d_model, topo.tp_group,
                                              init_std=cfg.init_std, device=device, dtype=dtype,
                                              tied_head=with_embedding and with_head and tied,
                                              sequence_parallel=sp)
        if with_embedding:
            if cfg.positions == "learned":  # rotary positions have no weights (models/rotary.py, in attention)
                self.wpe = nn.Embedding(cfg.n_positions, cfg.d_model, device=device, dtype=dtype)
            self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleDict({str(i): Block(cfg, topo, self.rng, device=device, dtype=dtype, kernels=self.kernels,
                                              sequence_parallel=sp, index=i) for i in self.layers})
        if with_head:
            self.ln_f = make_norm(cfg, self.kernels, device=device, dtype=dtype, sequence_parallel=sp)
            if not tied:  # untied head: column-parallel over the padded vocabulary (identity fwd, dx all-reduce bwd)
                self.lm_head = ColumnParallelLinear(cfg.d_model, self.vocab_padded, topo.tp_group, bias=False,
                                                    init_std=cfg.init_std, device=device, dtype=dtype,
                                                    sequence_parallel=sp)
        self.mtp, self._mtp_hidden, self._mtp_stats = None, None, []
        self.mtp_losses: list[torch.Tensor] = []  # each training loss's MTP mean CE (detached; the Trainer reports)
        if with_head and cfg.mtp_depth:  # DeepSeek-V3's multi-token prediction (models/deepseek/mtp.py)
            self.mtp = MTP(cfg, lambda index: Block(cfg, topo, self.rng, device=device, dtype=dtype,
                                                    kernels=self.kernels, sequence_parallel=sp, index=index),
                           sp, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`cache` (decoding, eval mode): x holds only the new positions, which follow the cached ones.
        `segment_ids` (b, s) (packed rows, models/packing.py): each example restarts its positions and attends
        only to itself; every stage of a pipeline needs them.

        Sequence parallelism: a stage's hidden-state input and output hold this rank's s / tp positions (the
        embedding's output is split after its all-reduce and dropout; the head all-gathers them back); decoding
        runs plain tensor parallelism."""
        if segment_ids is not None and cache is not None:
            raise ValueError("packed segment ids and a decoding cache cannot be combined: decode one example at a time")
        if segment_ids is not None and self.mtp is not None and self.training:  # its shifted targets cross examples
            raise ValueError(f"packed segment ids with multi-token prediction (model.mtp_depth = {self.cfg.mtp_depth})"
                             " in training: valid: model.mtp_depth = 0 for packed rows")
        if cache is not None and self.sequence_parallel.enabled:
            with self.sequence_parallel.suspended():
                return self._forward(x, cache, None)
        return self._forward(x, cache, segment_ids)

    def _forward(self, x: torch.Tensor, cache: KVCache | None, segment_ids: torch.Tensor | None) -> torch.Tensor:
        past = 0 if cache is None else cache.length
        segments = None if segment_ids is None else Segments.from_ids(segment_ids, self.cfg.sliding_window)
        if self.with_embedding:  # x: token ids (b, s)
            s = x.shape[1]
            if past + s * self.topo.cp > self.cfg.n_positions:  # cp > 1: x holds this rank's chunks of the sequence
                raise ValueError(f"sequence length {past + s * self.topo.cp} exceeds model.n_positions = "
                                 f"{self.cfg.n_positions}")
            x = self.wte(x)  # (b, s, d)
            if self.cfg.positions == "learned":
                pos = past + positions(s, self.topo.cp, self.topo.cp_rank, x.device)  # the chunks' own positions
                x = x + self.wpe(pos if segments is None else segments.positions)
            x = self.sequence_parallel.shard(self.drop(x))  # split after dropout: the same mask as without sp
        if cache is not None:
            cache.check_room(x.shape[1])
            for i, block in self.h.items():
                x = block(x, cache.layer(int(i)))
            cache.advance(x.shape[1])
        elif self.activation_checkpointing and self.training:
            for block in self.h.values():
                x = checkpoint(self.rng.replayable(block), x, None, segments, use_reentrant=False)
        else:
            for block in self.h.values():
                x = block(x) if segments is None else block(x, segments=segments)
        if not self.with_head:
            return x
        # the last block's output, which multi-token prediction continues from (training; speculative decoding's
        # draft, models/deepseek/speculative.py, reads it after a cached forward)
        self._mtp_hidden = x if self.mtp is not None and (self.training or cache is not None) else None
        x = self.ln_f(x)
        self._hidden = None
        if self.fused_loss and cache is None and torch.is_grad_enabled():
            self._hidden = weakref.ref(x)
            return x  # (b, s, d) (s / tp under sequence parallelism): the head runs in `loss`
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head on the final norm's output: this rank's vocabulary shard of the logits (b, s, V/tp)."""
        if not self.cfg.tie_embeddings:
            return self.lm_head(x)  # logits for this rank's vocab shard (b, s, V/tp)
        return self.wte.head(x)  # tied head: logits for this rank's vocab shard (b, s, V/tp)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy over non-ignored targets, from vocab-sharded logits; in training with
        multi-token prediction and the micro-batch's `inputs` (b, s), plus the MTP loss (`mtp_loss`).

        cp > 1: the mean is over the whole sequences (tokens counted over the cp group), and this rank's sum is
        scaled by cp: gradients are averaged over dp x cp, so the cp ranks' mean is the unsplit sequence's loss.
        Given a fused_loss forward's output (the final norm's), the head runs here, fused with the loss."""
        hidden = self._hidden is not None and self._hidden() is logits
        self._hidden = None
        if hidden:
            loss = self._fused_loss(logits, targets)
        else:
            per_token = self.kernels["cross_entropy"].fn(logits, targets, self.topo.tp_group, self.cfg.vocab_size)
            count = all_reduce_count((targets != -100).sum(), self.topo.cp_group)
            loss = per_token.sum() * self.topo.cp / count.clamp(min=1)
        self._mtp_stats = []
        if inputs is not None and self._mtp_hidden is not None:  # after the main head: a tied head's fused
            loss = loss + self.mtp_loss(targets, inputs)  # gradient pairs each lookup with its own head
        return self._with_moe_losses(loss)

    def mtp_loss(self, targets: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """mtp_loss_weight / D x the sum over depths k of the mean cross-entropy of t_{i+k+1}, continuing from the
        last training forward's hidden state (models/deepseek/mtp.py); cp is refused by the resolver."""
        hidden, self._mtp_hidden = self._mtp_hidden, None

        def embed(ids: torch.Tensor) -> torch.Tensor:  # split over tp under sequence parallelism, as the main one
            return self.sequence_parallel.shard(self.wte(ids))

        run = None
        if self.activation_checkpointing and self.training:  # each depth (norms, projection, block) as a block is
            def run(layer, *args):
                return checkpoint(self.rng.replayable(layer), *args, use_reentrant=False)
        total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        for k, out in enumerate(self.mtp(hidden, inputs, embed, run=run), start=1):
            shifted = mtp_targets(targets, k)
            per_token = self.kernels["cross_entropy"].fn(self.logits(out), shifted, self.topo.tp_group,
                                                         self.cfg.vocab_size)
            total = total + per_token.sum() / (shifted != -100).sum().clamp(min=1)
        self._mtp_stats = [layer.block.mlp.stats for layer in self.mtp.layers.values()
                           if isinstance(layer.block.mlp, MoE) and layer.block.mlp.stats is not None]
        mean = total / self.cfg.mtp_depth
        self.mtp_losses.append(mean.detach())
        return mean * self.cfg.mtp_loss_weight

    def _with_moe_losses(self, loss: torch.Tensor) -> torch.Tensor:
        if self.training and self.cfg.moe_aux_loss_scope == "model" and self.moe_stats():  # MoE: the router's
            # auxiliary losses of the last forward ("layer" scope: each MoE block injects its own in backward)
            loss = loss + self.moe_aux_losses()
        return loss

    def moe_stats(self) -> list[RouterStats]:
        """The RouterStats of this stage's MoE layers from the last forward (models/moe/losses.py), the MTP
        blocks' too where the last loss ran them."""
        return [block.mlp.stats for block in self.h.values()
                if isinstance(block.mlp, MoE) and block.mlp.stats is not None] + self._mtp_stats

    def moe_aux_losses(self) -> torch.Tensor:
        """moe_aux_loss_coef x load balancing + moe_z_loss_coef x z-loss, pooled over this stage's MoE layers
        (transformers' aux_loss pools over all of them: equal to it at pp = 1)."""
        stats = self.moe_stats()
        loss = self.cfg.moe_aux_loss_coef * load_balancing_loss(stats, self.cfg.n_experts)
        if self.cfg.moe_z_loss_coef:
            loss = loss + self.cfg.moe_z_loss_coef * z_loss(stats)
        if self.cfg.moe_seq_aux_loss_coef:  # DeepSeek-V3's sequence-wise loss: each layer's own, summed
            loss = loss + self.cfg.moe_seq_aux_loss_coef * sum(s.seq_aux for s in stats)
        return loss

    def _fused_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The head and the loss in one chunked pass: the logits never exist whole. The same collectives and casts
        as `logits` + `loss` (the head's tp region entry; under autocast 16-bit casts of its input and weight)."""
        kept = targets != -100
        count = all_reduce_count(kept.sum(), self.topo.cp_group)
        token_weight = kept.to(torch.float64) * self.topo.cp / count.clamp(min=1)
        shared = None
        if self.cfg.tie_embeddings:
            head, x = self.wte.weight, self.wte.sequence_parallel.enter(x)
            shared, self.wte._shared = self.wte._shared, None
            shared = shared if shared is not None and self.wte._fused() else None
        elif self.lm_head.lora is not None:  # adapters on the head: the plain head (recipes turn fusing off)
            return self.loss(self.lm_head(x), targets)
        else:
            head, x = self.lm_head.weight, self.sequence_parallel.enter(x)
        device = x.device.type
        if torch.is_autocast_enabled(device):  # what F.linear under autocast would multiply
            dtype = torch.get_autocast_dtype(device)
            x, head = x.to(dtype), head.to(dtype)
        with torch.autocast(device, enabled=False):
            return linear_cross_entropy(x, head, targets, token_weight, self.topo.tp_group, self.cfg.vocab_size,
                                        chunk_rows=self.loss_chunk_rows, shared=shared)
