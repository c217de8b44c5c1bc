"""What an MoE run shows per optimizer step: the router's losses and every MoE layer's expert load.

Each training forward of a chunk (a forward hook on it: activation checkpointing's recomputation reruns blocks,
never the chunk, so nothing counts twice) adds its MoE layers' RouterStats (models/moe/losses.py) into device
accumulators; nothing is read on the host there. At the end of the step `slots()` packs what every rank
contributes into the one tensor the Trainer already all-reduces and reads for the loss (Trainer._host_values),
so the figures cost no collective and no host read of their own. The fields of metrics.jsonl:

    moe_aux_loss      the load-balancing loss (transformers' aux_loss, before its coefficient), as the model
                      trains it: pooled over the layers (moe_aux_loss_scope "model") or the mean of the layers'
                      own ("layer"); the mean over micro-batches and dp x cp ranks (the whole batch's, losses.py)
    moe_z_loss        the router z-loss, the same way (when moe_z_loss_coef is on)
    moe_seq_aux_loss  DeepSeek-V3's sequence-wise loss summed over layers (when moe_seq_aux_loss_coef is on)
    moe_layers        the MoE layers' indices; the lists below follow them
    moe_load_max      per MoE layer, the most loaded expert's share: max_e C_e / mean_e C_e, C_e the step's top-k
                      assignments to expert e over every routing rank (dp x cp, tp under sequence parallelism)
                      and micro-batch, so every layout reports the same numbers
    moe_load_min      per MoE layer, min_e C_e / mean_e C_e
    moe_dropped       per MoE layer, assignments the capacity factor dropped (when moe_capacity_factor is on)

Who contributes what to the sum-all-reduce: the counts are already global in training (the MoE block sums them
over dp x cp and sequence-parallel tp), so one rank per pipeline stage (tp rank 0, dp x cp rank 0) writes its own
layers' slots; a loss is each rank's own (its probabilities over its rows), so tp rank 0 of every dp x cp rank
writes its value / (dp x cp), and the stages' layer sums add up. Under moe_aux_loss_scope "model" at pp > 1 (the
coefficients 0: pooling across stages is refused for training) the pooled loss has no stage to compute it and is
not reported.
"""

from __future__ import annotations

import torch

from megazoo.models.moe import MoE
from megazoo.models.moe.losses import load_balancing_loss, z_loss
from megazoo.parallel.topology import Topology


class MoEStepMetrics:
    """Device accumulators of one step's routing on this rank's chunks; `slots` / `read` around the all-reduce."""

    def __init__(self, chunks, cfg, topo: Topology):
        self.cfg, self.topo = cfg, topo
        self.layers = [i for i in range(cfg.n_layer) if cfg.moe_layer(i)]
        slot = {layer: j for j, layer in enumerate(self.layers)}
        self.blocks = [[(slot[int(key)], block.mlp) for key, block in chunk.h.items() if isinstance(block.mlp, MoE)]
                       for chunk in chunks]
        self.pooled = cfg.moe_aux_loss_scope == "model"
        self.report_aux = not self.pooled or topo.pp == 1
        device = topo.device
        self.counts = torch.zeros(len(self.layers), cfg.n_experts, dtype=torch.int64, device=device)
        self.dropped = torch.zeros(len(self.layers), dtype=torch.int64, device=device)
        self.losses = torch.zeros(3, dtype=torch.float64, device=device)  # aux, z, seq-aux sums over micro-batches
        ours = [j for blocks in self.blocks for j, _ in blocks] if topo.tp_rank == 0 and topo.grad_rank == 0 else []
        self.ours = torch.zeros(len(self.layers), dtype=torch.bool, device=device)
        for j in ours:  # the layers whose load this rank reports; a fill per layer: no host-to-device copy
            self.ours[j] = True
        self.hooks = [chunk.register_forward_hook(self._add(blocks)) for chunk, blocks in zip(chunks, self.blocks)]

    def _add(self, blocks):
        def hook(module, args, output):
            if not module.training or not blocks:
                return
            stats = [mlp.stats for _, mlp in blocks]
            for (j, _), s in zip(blocks, stats):
                self.counts[j] += s.counts.detach()
                self.dropped[j] += s.dropped.detach()
            cfg, n_moe = self.cfg, len(self.layers)
            with torch.no_grad():
                if self.pooled:
                    aux = load_balancing_loss(stats, cfg.n_experts)
                    z = z_loss(stats) if cfg.moe_z_loss_coef else None
                else:  # "layer": each layer's own, over the model's MoE layers (losses.layer_losses)
                    aux = sum(load_balancing_loss([s], cfg.n_experts) for s in stats) / n_moe
                    z = sum(z_loss([s]) for s in stats) / n_moe if cfg.moe_z_loss_coef else None
                self.losses[0] += aux.to(torch.float64)
                if z is not None:
                    self.losses[1] += z.to(torch.float64)
                if cfg.moe_seq_aux_loss_coef:
                    self.losses[2] += sum(s.seq_aux for s in stats).detach().to(torch.float64)
        return hook

    def slots(self, micro_batches: int) -> torch.Tensor:
        """This rank's contributions (float64, summed over all ranks by the caller's all-reduce): the three losses'
        shares, then per MoE layer max/mean, min/mean and dropped. Resets the accumulators."""
        topo = self.topo
        micro = max(micro_batches, 1)
        speaks = topo.tp_rank == 0
        losses = self.losses / (micro * topo.grad_size) if speaks else torch.zeros_like(self.losses)
        counts = self.counts.to(torch.float64)
        mean = counts.mean(1).clamp(min=1e-30)
        loads = torch.stack([counts.amax(1) / mean, counts.amin(1) / mean, self.dropped.to(torch.float64)])
        loads = torch.where(self.ours, loads, torch.zeros_like(loads))
        self.counts.zero_()
        self.dropped.zero_()
        self.losses.zero_()
        return torch.cat([losses, loads.reshape(-1)])

    def read(self, values: list[float]) -> dict:
        """The metrics.jsonl fields (module docstring) from the all-reduced slots."""
        cfg, n = self.cfg, len(self.layers)
        out: dict = {}
        if self.report_aux:
            out["moe_aux_loss"] = values[0]
            if cfg.moe_z_loss_coef:
                out["moe_z_loss"] = values[1]
        if cfg.moe_seq_aux_loss_coef:
            out["moe_seq_aux_loss"] = values[2]
        loads = values[3:]
        out.update(moe_layers=self.layers, moe_load_max=loads[:n], moe_load_min=loads[n:2 * n])
        if cfg.moe_capacity_factor:
            out["moe_dropped"] = [int(round(v)) for v in loads[2 * n:3 * n]]
        return out

    @property
    def size(self) -> int:
        return 3 + 3 * len(self.layers)


def progress_fields(metrics: dict) -> dict:
    """The progress line's MoE part: the aux loss and the most loaded expert's share over the MoE layers."""
    out = {}
    if "moe_aux_loss" in metrics:
        out["aux"] = f"{metrics['moe_aux_loss']:.4f}"
    if metrics.get("moe_load_max"):
        out["load_max"] = f"{max(metrics['moe_load_max']):.2f}"
    if metrics.get("moe_dropped"):
        out["dropped"] = str(sum(metrics["moe_dropped"]))
    return out


def set_aux_grad_scale(chunks, scale: float) -> None:
    """The gradient the "layer"-scope router losses inject in backward (models/moe/losses.AuxLossScaler): the scale
    the engine backpropagates the loss with (the fp16 loss scale / the step's micro-batches), so the router losses
    weigh against the loss as they would added to it, whatever the accumulation (Megatron's
    MoEAuxLossAutoScaler.set_loss_scale). A plain attribute per MoE block, set before every step: no state shared
    between models."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoE):
                module.aux_grad_scale = scale
