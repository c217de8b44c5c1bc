"""DiLoCo (Douillard et al. 2023): groups that train alone for H steps, then one outer step across them.

`[diloco]` (config.py). The groups are HSDP's nodes (zero.shard_group = "node", parallel.node_size): inside a
node the recipe's ZeRO stage 1 or 2 runs as usual (reduce-scatter of the gradients over the node's dp ranks,
AdamW on each rank's owned fp32 master chunk, all-gather), but the gradients never cross nodes
(build_zero(replica_reduce=False)); stage 0 (zero.shard_group "dp") all-reduces them over the node's dp ranks and
its "chunks" are the whole parameters. Every H-th applied inner step, between the AdamW update and the all-gather
(ZeroStage12.after_update), each rank runs the outer step on its owned chunk:

  outer gradient   delta = anchor - master (anchor: the chunk at the last outer step), averaged over the ranks
                   that own the same chunk on the other nodes (`Topology.dp_inter_group`, HSDP's replica group);
                   on the wire as fp32/fp64 (an all-reduce), or compressed with error feedback: "onebit" (1-bit
                   Adam's sign compression, parallel/compressed/comms.py) or "int8" (qwZ's int8 blocks,
                   parallel/zero/quantized.py; each node's blocks all-gathered, every rank sums them in node order)
  outer optimizer  torch SGD(outer_lr, outer_momentum, nesterov) on the anchor with that gradient
  continue         master = anchor on every node (the inner AdamW moments stay each group's own)

Communication across nodes: nothing on the H - 1 other steps; on the H-th one all-reduce of each owned chunk
(or per chunk one all-to-all + one all-gather of sign bytes, or two all-gathers of int8 + scales).

Why not torchft's DiLoCo (torchft.local_sgd.DiLoCo): it snapshots, all-reduces and steps an outer optimizer over a
module's whole `parameters()` through a torchft Manager. Under ZeRO 1-2 what AdamW updates is each rank's owned
fp32 master chunk, the module's parameters are a copy all-gathered from those chunks (bf16 in mixed precision):
an outer step on them would be overwritten by the next gather, and every rank would send the whole model rather
than its chunk. The algorithm therefore runs here, on the chunks, over megazoo's own node groups.

Checkpoints: the ZeRO stage's views hold node 0's state (the other nodes' replicas write nothing); each rank's
own anchor, outer momentum, error buffers, inner masters and Adam moments and the steps since the last outer step
go into its per-rank file (rank_state), so a resume in the same layout continues exactly, also between outer
steps. In another layout every group starts from the loaded (node 0's) state, momentum and errors at zero.
"""

from __future__ import annotations

import torch

from megazoo.parallel.checkpoint.views import ensure_adam_state
from megazoo.parallel.collectives import all_gather_flat, all_reduce
from megazoo.parallel.compressed.comms import compressed_all_reduce, padded_numel
from megazoo.parallel.fault_tolerance.config import DiLoCoConfig
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.quantized import dequantize_blocks, quantize_blocks

INT8_KIND = "diloco_int8_all_gather"


class DiLoCo:
    """A ZeroOptimizer (parallel/zero/interface.py) wrapping a ZeRO stage 0-2 whose gradients stay in the node;
    the one optimizer step stays interface.optimizer_step's, the outer step runs inside the stage's step()."""

    def __init__(self, inner, topo: Topology, settings: DiLoCoConfig):
        node_only = inner.node_only if hasattr(inner, "node_only") else inner.groups.replica_group is None
        if not hasattr(inner, "after_update") or not node_only:
            raise ValueError("DiLoCo needs a ZeRO stage 0-2 optimizer built with replica_reduce=False (its "
                             "gradients averaged inside the node only)")
        if topo.dp_inter_group is None or topo.dp_nodes < 2:
            raise ValueError(f"diloco needs 2 or more nodes of dp ranks (groups); this layout has {topo.dp_nodes}: "
                             "set parallel.node_size to the processes per node")
        self.inner, self.topo, self.settings = inner, topo, settings
        self.optimizer, self.comm = inner.optimizer, inner.comm
        self.group, self.groups = topo.dp_inter_group, topo.dp_nodes
        self.since_sync = 0  # inner steps applied since the last outer step
        self.outer_steps = 0
        with torch.no_grad():
            self.anchors = [m.detach().clone() for m in inner.masters]
        self.outer = self._outer_optimizer()
        self._fresh_errors()
        inner.after_update = self._after_inner_update

    def _outer_optimizer(self) -> torch.optim.Optimizer:
        s = self.settings
        return torch.optim.SGD(self.anchors, lr=s.outer_lr, momentum=s.outer_momentum,
                               nesterov=s.nesterov and s.outer_momentum > 0, foreach=False)

    def _fresh_errors(self) -> None:
        """Error-feedback buffers of the compressed outer gradients, zero (none uncompressed)."""
        kind, g = self.settings.compression, self.groups
        self.worker_error, self.server_error, self.error = [], [], []
        for a in self.anchors:
            if kind == "onebit":
                padded = padded_numel(a.numel(), g)
                self.worker_error.append(torch.zeros(padded, dtype=a.dtype, device=a.device))
                self.server_error.append(torch.zeros(padded // g, dtype=a.dtype, device=a.device))
            elif kind == "int8":
                self.error.append(torch.zeros(a.numel(), dtype=a.dtype, device=a.device))

    # ---- the outer step ---------------------------------------------------------------------------------------
    def _after_inner_update(self) -> None:
        self.since_sync += 1
        if self.since_sync >= self.settings.inner_steps:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average (anchor - master) over the groups, one outer SGD step on the anchors, masters = anchors."""
        for k, (anchor, master) in enumerate(zip(self.anchors, self.inner.masters)):
            anchor.grad = self._average(k, torch.sub(anchor, master).view(-1)).view_as(anchor)  # stage 0: 2-D
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for anchor, master in zip(self.anchors, self.inner.masters):
            master.copy_(anchor)
        self.since_sync = 0
        self.outer_steps += 1

    def _average(self, k: int, delta: torch.Tensor) -> torch.Tensor:
        """The groups' mean of `delta` (this group's outer gradient of chunk k), identical on every group."""
        kind, g, n = self.settings.compression, self.groups, delta.numel()
        if kind == "none":
            return all_reduce(delta, self.group, ledger=self.comm).div_(g)
        if kind == "onebit":
            x = torch.zeros(self.worker_error[k].numel(), dtype=delta.dtype, device=delta.device)
            x[:n] = delta
            compressed_all_reduce(x, self.worker_error[k], self.server_error[k], self.group, ledger=self.comm)
            return x[:n].clone()
        y = delta.add_(self.error[k])  # int8: what was dropped last time goes out now
        q, scale = quantize_blocks(y)
        torch.sub(y, dequantize_blocks(q, scale)[:n].to(y.dtype), out=self.error[k])
        qs = torch.empty(g * q.numel(), dtype=q.dtype, device=q.device)
        scales = torch.empty(g * scale.numel(), dtype=scale.dtype, device=scale.device)
        all_gather_flat(qs, q, self.group, ledger=self.comm, kind=INT8_KIND)
        all_gather_flat(scales, scale, self.group, ledger=self.comm, kind=INT8_KIND)
        total = torch.zeros(n, dtype=y.dtype, device=y.device)
        for part_q, part_s in zip(qs.view(g, -1), scales.view(g, -1)):  # node order: the same sum everywhere
            total += dequantize_blocks(part_q, part_s)[:n].to(y.dtype)
        return total.div_(g)

    # ---- the ZeroOptimizer interface: the node's ZeRO stage ----------------------------------------------------
    def begin_micro_batch(self, last: bool) -> None:
        self.inner.begin_micro_batch(last)

    def finish_gradients(self) -> None:
        self.inner.finish_gradients()

    def gradients(self) -> list[torch.Tensor]:
        return self.inner.gradients()

    def grad_norm(self) -> torch.Tensor:
        return self.inner.grad_norm()  # over the node: each group clips its own gradient

    def clip_(self, total_norm: torch.Tensor, max_norm: float) -> None:
        self.inner.clip_(total_norm, max_norm)

    def zero_grads_(self) -> None:
        self.inner.zero_grads_()

    def step(self, lr: float) -> None:
        self.inner.step(lr)  # AdamW, on every H-th call the outer step, then the node's all-gathers

    def gathered(self):
        return self.inner.gathered()

    def state_views(self):
        return self.inner.state_views()

    @torch.no_grad()
    def after_load(self) -> None:
        """Loaded weights (also weights only: no load_rank_state follows) are the new last sync point."""
        self.inner.after_load()
        for anchor, master in zip(self.anchors, self.inner.masters):
            anchor.copy_(master)
        self.outer = self._outer_optimizer()
        self._fresh_errors()
        self.since_sync, self.outer_steps = 0, 0

    def memory_bytes(self) -> dict[str, int]:
        out = dict(self.inner.memory_bytes())
        extra = self.anchors + self.worker_error + self.server_error + self.error
        extra += [s["momentum_buffer"] for s in self.outer.state.values() if s.get("momentum_buffer") is not None]
        out["optimizer"] += sum(t.numel() * t.element_size() for t in extra)
        return out

    def __getattr__(self, name: str):  # the stage's other attributes (buckets, reducer, wait_s) for benchmarks
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- per-rank state (checkpoints) -------------------------------------------------------------------------
    def rank_state(self) -> dict:
        """What the views do not hold: this group's own anchor, outer momentum, error buffers, inner masters
        and Adam moments (the views hold node 0's), and where in the H steps it is. Copies (an async save)."""
        ensure_adam_state(self.optimizer, self.inner.masters)
        moments = [(self.optimizer.state[m]["exp_avg"], self.optimizer.state[m]["exp_avg_sq"])
                   for m in self.inner.masters]
        momentum = [self.outer.state.get(a, {}).get("momentum_buffer") for a in self.anchors]

        def copies(tensors):
            return [None if t is None else t.detach().clone() for t in tensors]
        return {"diloco": {"groups": self.groups, "since_sync": self.since_sync, "outer_steps": self.outer_steps,
                           "anchors": copies(self.anchors), "momentum": copies(momentum),
                           "worker_error": copies(self.worker_error), "server_error": copies(self.server_error),
                           "error": copies(self.error), "masters": copies(self.inner.masters),
                           "exp_avg": copies([m[0] for m in moments]), "exp_avg_sq": copies([m[1] for m in moments])}}

    @torch.no_grad()
    def load_rank_state(self, state: dict | None) -> None:
        """After the views were loaded: this rank's own state from its file when the layout is the same, else
        every group from the loaded state (anchor = it, momentum and errors zero). Collective: the node's
        all-gather of the parameters (they were loaded as node 0's)."""
        mine = (state or {}).get("diloco")
        if mine is not None and (mine["groups"] != self.groups
                                 or [t.numel() for t in mine["anchors"]] != [a.numel() for a in self.anchors]):
            mine = None
        if mine is None:  # after_load already made the loaded state the last sync point
            return
        ensure_adam_state(self.optimizer, self.inner.masters)
        for k, master in enumerate(self.inner.masters):
            state_k = self.optimizer.state[master]
            for target, saved in ((self.anchors[k], mine["anchors"][k]), (master, mine["masters"][k]),
                                  (state_k["exp_avg"], mine["exp_avg"][k]),
                                  (state_k["exp_avg_sq"], mine["exp_avg_sq"][k])):
                target.copy_(saved)
            if mine["momentum"][k] is not None:
                self.outer.state[self.anchors[k]]["momentum_buffer"] = mine["momentum"][k].to(master.device).clone()
        for mine_e, saved in zip(self.worker_error + self.server_error + self.error,
                                 mine["worker_error"] + mine["server_error"] + mine["error"]):
            mine_e.copy_(saved)
        self.since_sync, self.outer_steps = int(mine["since_sync"]), int(mine["outer_steps"])
        inner = self.inner
        for i, b in enumerate(getattr(inner, "buckets", ())):  # stages 1-2: this group's parameters from its masters
            owned = b.flat_params[b.owned]
            inner.write_owned(i, owned)
            if inner.group is not None:
                all_gather_flat(b.flat_params, owned, inner.group, ledger=inner.comm)
