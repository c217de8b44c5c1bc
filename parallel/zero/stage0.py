"""ZeRO stage 0: plain data parallelism behind the same interface as stages 1-3.

Every rank keeps full parameters, gradients and optimizer states; after backward one bucketed all-reduce
(sum, then / dp) over the dp group averages the gradients (parallel/data_parallel.py), and every rank takes the
same AdamW step. Used by the Trainer so that one loop drives every stage.
"""

from __future__ import annotations

import torch

from megazoo.parallel.checkpoint.views import StateView, drop_gradients, ensure_adam_state, whole_param_views
from megazoo.parallel.collectives import CommLedger
from megazoo.parallel.data_parallel import all_reduce_gradients
from megazoo.parallel.grad_norm import clip_gradients_, global_grad_norm
from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.interface import NothingToGather
from megazoo.parallel.zero.partitioned import TiedParameters


class DataParallelAdamW(NothingToGather):
    def __init__(self, named: list[tuple[str, torch.nn.Parameter, ShardSpec]], topo: Topology, *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float,
                 tied: TiedParameters = TiedParameters(), adamw=None):
        self.named, self.topo, self.tied = named, topo, tied
        self.params = [p for _, p, _ in named if p.requires_grad]
        groups = [{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}]
        # No weight decay on biases and LayerNorm parameters (every 1-D tensor), as GPT-2.
        adamw = adamw or torch.optim.AdamW  # kernels' adamw op
        self.optimizer = adamw([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
        self.comm = CommLedger()

    def begin_micro_batch(self, last: bool) -> None:
        """Gradients accumulate in .grad over the micro-batches; the all-reduce runs once per step."""

    @torch.no_grad()
    def finish_gradients(self) -> None:
        if self.tied.group is not None:  # the embedding's two copies (first and last stage) get the summed grad
            for name, p, _ in self.named:
                if name in self.tied.names and p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=self.tied.group)
        all_reduce_gradients(self.params, self.topo.dp_group, ledger=self.comm)

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        skip = frozenset() if self.tied.counted_in_norm else self.tied.names
        return global_grad_norm(self.named, self.topo, skip)

    def clip_(self, total_norm: torch.Tensor, max_norm: float) -> None:
        clip_gradients_(self.params, total_norm, max_norm)

    def zero_grads_(self) -> None:
        drop_gradients(self.optimizer)

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        drop_gradients(self.optimizer)

    def state_views(self) -> list[StateView]:
        """Full parameters (also the fp32 masters here) and Adam moments; dp rank 0 writes them."""
        ensure_adam_state(self.optimizer, self.params)
        write = self.topo.dp_rank == 0
        return [view for name, p, spec in self.named if p.requires_grad
                for view in whole_param_views(name, spec, p, self.optimizer.state[p], write)]

    def after_load(self) -> None:
        """Parameters and moments were loaded in place."""

    def memory_bytes(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(g.numel() * g.element_size() for g in self.gradients())
        states = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                     if torch.is_tensor(t) and t.dim())
        return {"params": params, "grads": grads, "optimizer": states}
