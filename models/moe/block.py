"""The MoE block, in place of a block's dense MLP: router, token dispatcher, routed experts, shared experts.

    x (b, s, d) -> rows (T, d) -> router logits (T, E) fp32 -> top-k weights and indices (router.py)
                -> dispatcher(rows, weights, indices, experts) (dispatch.py; experts.py) -> (T, d)
                [+ shared SwiGLU(x), times sigmoid(x . g) when gated (Qwen2-MoE)] -> (b, s, d)

Parameter names (models/layout.py): mlp.router.weight (E, d); mlp.experts.c_fc.weight (E, 2 f, d) [gate; up] and
mlp.experts.c_proj.weight (E, d, f), global shapes (an ep rank holds its experts' rows of dim 0); mlp.shared.c_fc
/ c_proj (a tensor-parallel SwiGLU of width moe_shared_experts x moe_shared_d_ff); mlp.shared_gate.weight (1, d).

Tensor parallelism (models/moe/__init__.py): router, gate and experts are replicated (expert-tp 1); the rows a tp
rank routes are all the tokens, or under sequence parallelism its own s / tp positions (its replicated weights'
gradients all-reduced over tp, its router statistics summed over tp so the aux loss is the whole batch's).

Under moe_router = "sigmoid_bias" each training forward adds its counts (over every routing rank: tp under
sequence parallelism, dp x cp) to router.load, which update_expert_bias (router.py) turns into the bias update.

After each forward `stats` holds this layer's RouterStats (losses.py): the decoder pools them into the aux losses.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.models.attention import residual_std
from megazoo.models.config import ModelConfig
from megazoo.models.mlp import SwiGLU
from megazoo.models.moe.dispatch import TokenDispatcher, make_dispatcher
from megazoo.models.moe.experts import ExpertComputation
from megazoo.models.moe.losses import AuxLossScaler, RouterStats, layer_losses, sequence_balance_loss
from megazoo.models.moe.router import Router, route
from megazoo.parallel.tensor import SequenceParallel, ShardSpec, reduce_from_tp_region
from megazoo.parallel.tensor.sequence import plain
from megazoo.parallel.topology import Topology


class SharedGate(nn.Module):
    """Qwen2-MoE's shared-expert gate: sigmoid(x . w), w (1, d), replicated over tp."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, *, replicated=None):
        super().__init__()
        self.init_std = cfg.init_std
        self.replicated = replicated if replicated is not None else (lambda p: p)
        self.weight = nn.Parameter(torch.empty(1, cfg.d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, d) -> (b, s, 1)
        return torch.sigmoid(F.linear(x, self.replicated(self.weight)))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, topo: Topology, device=None, dtype=None, *,
                 sequence_parallel: SequenceParallel | None = None, dispatcher: TokenDispatcher | None = None):
        super().__init__()
        self.cfg, self.topo = cfg, topo
        self.sequence_parallel = sequence_parallel if sequence_parallel is not None else plain(topo.tp_group)
        self.dispatcher = dispatcher if dispatcher is not None else make_dispatcher(cfg, topo)
        local = self.dispatcher.local_experts
        replicated = self._replicated
        self.router = Router(cfg, device=device, dtype=dtype, replicated=replicated)
        self.experts = ExpertComputation(len(local), cfg.d_model, cfg.moe_d_ff, cfg.init_std, residual_std(cfg),
                                         cfg.moe_experts_impl, device=device, dtype=dtype, replicated=replicated)
        if len(local) < cfg.n_experts:  # expert parallelism: this rank's block of dim 0 (checkpoints, init)
            ep = cfg.n_experts // len(local)
            for weights in (self.experts.c_fc, self.experts.c_proj):
                global_shape = (cfg.n_experts, *weights.weight.shape[1:])
                weights.shard_specs = {"weight": ShardSpec(global_shape, dim=0, rank=local.start // len(local),
                                                           size=ep)}
        if cfg.moe_shared_experts:
            shared = cfg.replace(d_ff=cfg.moe_shared_experts * cfg.moe_shared_d_ff, n_experts=0)
            self.shared = SwiGLU(shared, topo, device=device, dtype=dtype, sequence_parallel=self.sequence_parallel)
            if cfg.moe_shared_gate:
                self.shared_gate = SharedGate(cfg, device=device, dtype=dtype, replicated=replicated)
        if cfg.moe_seq_aux_loss_coef and topo.cp > 1:
            raise ValueError(f"model.moe_seq_aux_loss_coef = {cfg.moe_seq_aux_loss_coef} is not built for context "
                             f"parallelism (cp = {topo.cp} splits each sequence); set it to 0 or cp = 1")
        self.stats: RouterStats | None = None
        self.aux_grad_scale = 1.0  # the "layer"-scope losses' backward scale (losses.AuxLossScaler), set per step

    def _replicated(self, param: torch.Tensor) -> torch.Tensor:
        # read at call time: decoding suspends sequence parallelism for the whole model
        return self.sequence_parallel.replicated(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, d) -> (b, s, d); (b, s/tp, d) under sp
        shape = x.shape
        rows = x.reshape(-1, shape[-1])  # (T, d)
        logits, weights, indices, scores = self.route_rows(rows)
        # training: every rank routes as many rows (a capacity factor's padded splits are then static)
        done = self.dispatcher(rows, weights, indices, self.experts, same_shapes=self.training)
        stats = self.record(logits, scores, indices, done.counts, done.dropped, shape[0])
        out = self.with_layer_losses(done.out.view(shape), stats)
        return out + self.shared_out(x) if self.cfg.moe_shared_experts else out

    # The pieces of forward, which the forward/backward overlap's sub-stages (recipes/training/moe_metrics.py)
    # call around its own dispatch.
    def route_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, d) -> router logits (T, E) fp32, top-k weights, indices, scores."""
        logits = self.router(rows)  # (T, E) fp32
        cfg = self.cfg
        weights, indices, scores = route(logits, cfg.moe_top_k, cfg.moe_router, cfg.moe_norm_topk_prob,
                                         bias=self.router.expert_bias, n_group=cfg.moe_n_group,
                                         topk_group=cfg.moe_topk_group, scaling=cfg.moe_routed_scaling_factor,
                                         nodes=cfg.moe_nodes, max_nodes=cfg.moe_max_nodes)
        return logits, weights, indices, scores

    def record(self, logits: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor,
               dropped: torch.Tensor, batch: int) -> RouterStats:
        """This forward's RouterStats (kept in self.stats) and, under sigmoid_bias training, the routing load."""
        cfg = self.cfg
        stats = RouterStats.of(logits, counts, dropped)
        if self.sequence_parallel.active:  # each tp rank routed its own positions: the batch's statistics
            group = self.sequence_parallel.group  # the sums: all-reduce forward, identity backward
            stats = stats.reduced(self.topo.tp, lambda t: reduce_from_tp_region(t.detach(), group),
                                  lambda t: reduce_from_tp_region(t, group))
        if self.topo.grad_size > 1 and self.training:  # data-parallel ranks: the whole batch's expert counts
            # (losses.py); in training only, where every rank runs the same forwards (eval may split unevenly)
            group = self.topo.grad_group
            stats = stats.counted_over(self.topo.grad_size, lambda t: reduce_from_tp_region(t.detach(), group))
        if cfg.moe_seq_aux_loss_coef and self.training:  # losses.py; the decoder's loss adds it
            sp = self.sequence_parallel
            stats.seq_aux = sequence_balance_loss(
                scores, indices, batch, cfg.moe_top_k, lambda t: reduce_from_tp_region(t.detach(), sp.group),
                lambda t: reduce_from_tp_region(t, sp.group), self.topo.tp if sp.active else 1)
        self.stats = stats
        if self.router.expert_bias is not None and self.training:  # the step's load for update_expert_bias
            self.router.load += stats.counts.detach()
        return stats

    def with_layer_losses(self, out: torch.Tensor, stats: RouterStats) -> torch.Tensor:
        """out, carrying the "layer"-scope losses' gradient (AuxLossScaler) in training."""
        cfg = self.cfg
        if cfg.moe_aux_loss_scope == "layer" and self.training and (cfg.moe_aux_loss_coef or cfg.moe_z_loss_coef):
            n_moe = sum(cfg.moe_layer(i) for i in range(cfg.n_layer))
            out = AuxLossScaler.apply(out, layer_losses(stats, cfg.n_experts, cfg.moe_aux_loss_coef,
                                                        cfg.moe_z_loss_coef, n_moe), self.aux_grad_scale)
        return out

    def shared_out(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts on the block's input (b, s, d), gated under Qwen2-MoE."""
        shared = self.shared(x)
        return self.shared_gate(x) * shared if self.cfg.moe_shared_gate else shared
