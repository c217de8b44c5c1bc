"""ZeRO stage 0: plain data parallelism behind the same interface as stages 1-3.

Every rank keeps full parameters, gradients and optimizer states. Gradients are views into flat buckets and
each bucket's all-reduce (sum, then / dp) over the dp group is launched from a gradient hook as soon as backward
has filled it, overlapping the rest of backward, as torch DDP does (parallel/data_parallel.py); every rank then
takes the same AdamW step. Used by the Trainer so that one loop drives every stage.
"""

from __future__ import annotations

import torch

from megazoo.parallel.checkpoint.views import StateView, ensure_adam_state, whole_param_views
from megazoo.parallel.collectives import CommLedger
from megazoo.parallel.data_parallel import BUCKET_ELEMENTS, GradientAllReducer
from megazoo.parallel.grad_norm import flat_grad_norm
from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.interface import NothingToGather
from megazoo.parallel.zero.partitioned import TiedParameters


class DataParallelAdamW(NothingToGather):
    def __init__(self, named: list[tuple[str, torch.nn.Parameter, ShardSpec]], topo: Topology, *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float,
                 tied: TiedParameters = TiedParameters(), adamw=None, bucket_elements: int = BUCKET_ELEMENTS,
                 node_only: bool = False):
        self.named, self.topo, self.tied = named, topo, tied
        self.params = [p for _, p, _ in named if p.requires_grad]
        self.masters = self.params  # what AdamW updates (DiLoCo's outer step works on the same tensors)
        # DiLoCo (parallel/fault_tolerance/diloco.py): gradients averaged over the node's dp ranks only, and its
        # outer step run by step() right after AdamW
        self.node_only = node_only
        self.after_update = None
        groups = [{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}]
        # No weight decay on biases and LayerNorm parameters (every 1-D tensor), as GPT-2.
        adamw = adamw or torch.optim.AdamW  # kernels' adamw op
        self.optimizer = adamw([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
        self.comm = CommLedger(node_size=topo.node_size)  # bytes per link class once the node size is known
        # One bucket rule per bucket: tp-sharded or replicated (the norm's split), tied (summed over the pipeline
        # ends, maybe left out of the norm) or not.
        sharded = {p: spec.dim is not None and spec.size > 1 for _, p, spec in named}
        tied_params = {p for name, p, _ in named if name in tied.names}
        self.reducer = GradientAllReducer(self.params, topo.dp_cp_intra_group if node_only else topo.grad_group,
                                          bucket_elements, self.comm,
                                          key=lambda p: (sharded[p], p in tied_params))

    def begin_micro_batch(self, last: bool) -> None:
        """Gradients accumulate in the buckets over the micro-batches; the last backward all-reduces them."""
        self.reducer.begin(reduce=last)

    @torch.no_grad()
    def finish_gradients(self) -> None:
        self.reducer.finish()
        if self.tied.group is not None:  # the embedding's two copies (first and last stage) get the summed grad
            for (_, is_tied), flat in zip(self.reducer.keys, self.reducer.flats):
                if is_tied:
                    torch.distributed.all_reduce(flat, group=self.tied.group)

    def gradients(self) -> list[torch.Tensor]:
        return self.reducer.flats

    def grad_norm(self) -> torch.Tensor:
        return flat_grad_norm([(flat, is_sharded) for (is_sharded, is_tied), flat
                               in zip(self.reducer.keys, self.reducer.flats)
                               if self.tied.counted_in_norm or not is_tied], self.topo)

    @torch.no_grad()
    def clip_(self, total_norm: torch.Tensor, max_norm: float) -> None:
        coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule
        for flat in self.reducer.flats:
            flat.mul_(coef.to(flat.dtype))

    def zero_grads_(self) -> None:
        self.reducer.zero_()

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.after_update is not None:
            self.after_update()
        self.reducer.zero_()

    def state_views(self) -> list[StateView]:
        """Full parameters (also the fp32 masters here) and Adam moments; dp rank 0 writes them."""
        ensure_adam_state(self.optimizer, self.params)
        write = self.topo.grad_rank == 0
        return [view for name, p, spec in self.named if p.requires_grad
                for view in whole_param_views(name, spec, p, self.optimizer.state[p], write)]

    def after_load(self) -> None:
        """Parameters and moments were loaded in place."""

    def memory_bytes(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for _, p, _ in self.named)  # frozen ones (LoRA's base) too
        grads = sum(g.numel() * g.element_size() for g in self.gradients())
        states = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                     if torch.is_tensor(t) and t.dim())
        return {"params": params, "grads": grads, "optimizer": states}
