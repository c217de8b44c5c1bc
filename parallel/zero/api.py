"""ZeRO for any `torch.nn.Module`: one engine object replaces the optimizer, the dp all-reduce and clipping.

The DeepSpeed promise, on megazoo's ZeRO stages: a training loop written for one process becomes a ZeRO-1/2/3
data-parallel loop by changing about five lines. Works for Hugging Face models (tied `lm_head.weight` /
`transformer.wte.weight` included), megazoo's own GPT, or any other module.

Usage (launch with `torchrun --nproc-per-node 2 train.py`)::

    import os, torch, torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    from megazoo.parallel.topology import Topology, init_distributed
    from megazoo.parallel.zero.api import ZeroEngine

    init_distributed(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), init_method="env://")
    torch.manual_seed(0)                                   # (rank 0's weights are broadcast anyway)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12))
    # was: optimizer = torch.optim.AdamW(groups, lr=3e-4, weight_decay=0.1)
    engine = ZeroEngine(model, Topology.build(dp=dist.get_world_size()), stage=3, lr=3e-4,
                        weight_decay=0.1, grad_clip=1.0, grad_accum=2)
    # multi-node: Topology.build(dp=..., node_size=int(os.environ["LOCAL_WORLD_SIZE"])) and e.g.
    # shard_group="node" (HSDP) or hpz=True, quantized_weights=True, quantized_gradients="int8" (ZeRO++)
    for batch in loader:                                   # this rank's micro-batches (DistributedSampler)
        loss = model(**batch).loss                         # unchanged (or engine(**batch))
        engine.backward(loss)                              # was: (loss / 2).backward()
        engine.step()                                      # was: clip_grad_norm_ + optimizer.step() + zero_grad()
    state = engine.full_state_dict()                       # full weights on every rank, whatever the stage
    dist.destroy_process_group()

`engine.step()` is called after every micro-batch, as in DeepSpeed: it does the optimizer step only at the
accumulation boundary (every `grad_accum` backward calls, or a backward with `last=True`) and returns the
global gradient norm there (before clipping, as `clip_grad_norm_`), None otherwise.

Stages (parallel/zero/build.py): 0 = plain data parallelism (all-reduce the gradients, torch AdamW),
1 = optimizer states partitioned, 2 = + gradients, 3 = + parameters, gathered per unit. Stage 3's units
default to the children of the model's largest `nn.ModuleList` / `nn.ModuleDict` (GPT-2: `transformer.h`);
every other parameter forms the root unit.
AdamW decays every parameter with >= 2 dims (matrices, embeddings), never biases or LayerNorm weights.

fp16: store the model in fp16 (`model.half()`), use stage >= 1 (the partitioned optimizer keeps fp32 masters) and
pass `loss_scaler=DynamicLossScaler()` (parallel/zero/loss_scaler.py): the loss is multiplied by the scale in
`backward`, and a step whose gradients overflow on any rank is skipped everywhere (`step()` returns NaN).
bf16 needs no scaler: keep fp32 parameters and run the forward under `torch.autocast`, or store bf16 (stage >= 1).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from megazoo.parallel.tensor import full_state_dict, unique_named_shards
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.buckets import DEFAULT_BUCKET_ELEMENTS
from megazoo.parallel.zero.build import build_zero
from megazoo.parallel.zero.interface import optimizer_step
from megazoo.parallel.zero.loss_scaler import DynamicLossScaler
from megazoo.parallel.zero.stage3 import InitFn


def default_units(model: nn.Module) -> list[nn.Module]:
    """The children of the model's ModuleList/ModuleDict with the most parameters (a GPT's blocks); [] when it
    has none (stage 3 then gathers the whole model as one unit: correct, but no memory saved)."""
    containers = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
    if not containers:
        return []
    size = lambda c: sum(p.numel() for p in c.parameters())  # noqa: E731
    return list(max(containers, key=lambda c: (size(c), len(c))).children())


class ZeroEngine:
    """Wraps `model` for ZeRO-`stage` data parallelism over `topology.dp_group`; see the module docstring.

    `lr` is read at every step (settable: `engine.lr = ...`), unless `lr_schedule(step) -> lr` is given.
    The model is moved to `topology.device` first (where the collectives run).
    `units` (stage 3): modules or their qualified names. `init_fn(owner, name, tensor, spec)` initialises a
    model built on the meta device, one unit at a time (stage 3 only). `offload="cpu"`: ZeRO-Offload (stage
    >= 1). `loss_scaler`: fp16 dynamic loss scaling. `engine.comm` counts this rank's communication.

    Node-aware ZeRO and ZeRO++ (parallel/zero/groups.py; the recipe's [zero] keys of the same names), for a
    topology built with `node_size` (processes per node): `shard_group="node"` is HSDP (stages 1-3 partition
    inside a node, the owned gradient chunks cross nodes once per step), `hpz=True` stage 3's backward gathers
    inside the node (ZeRO++ hpZ), `quantized_weights=True` stage 3's gathers in int8 blocks (qwZ; the masters
    and full_state_dict stay exact), `quantized_gradients="int8" | "int4"` the hierarchical quantized gradient
    reduce (qgZ, stages 1-3, flat or hpZ). `fp8_all_gather=True` (stage 3, FP8 tensorwise linears): their
    weights gathered as float8 e4m3 with one scale per weight (gather/fp8.py).
    """

    def __init__(self, model: nn.Module, topology: Topology, *, stage: int = 2, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 grad_clip: float = 0.0, grad_accum: int = 1, lr_schedule: Callable[[int], float] | None = None,
                 units: Sequence[nn.Module | str] | None = None, init_fn: InitFn | None = None,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, offload: str = "none",
                 loss_scaler: DynamicLossScaler | None = None, broadcast_parameters: bool = True,
                 shard_group: str = "dp", hpz: bool = False, quantized_weights: bool = False,
                 quantized_gradients: str = "none", fp8_all_gather: bool = False):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage = {stage!r} is invalid; valid: 0, 1, 2, 3")
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise ValueError(f"grad_accum = {grad_accum!r} is invalid: it must be a positive integer")
        self.module, self.topo, self.stage = model, topology, stage
        self.lr, self.lr_schedule, self.grad_clip, self.grad_accum = lr, lr_schedule, grad_clip, grad_accum
        self.loss_scaler = loss_scaler
        self.step_count = 0  # optimizer steps taken (the lr_schedule's argument)
        self.skipped_steps = 0  # steps dropped because fp16 gradients overflowed
        self._micro = 0  # backward calls since the last boundary
        self._boundary = False  # a backward closed an accumulation window: step() must update
        tensors = list(model.parameters()) + list(model.buffers())
        if any(t.device != topology.device for t in tensors if not t.is_meta):
            # A model built on the CPU for a GPU job: NCCL broadcasts and stage-3 buckets need it on the device.
            model.to(topology.device)
        named, self.aliases = unique_named_shards(model)
        meta = any(p.is_meta for _, p, _ in named)
        if init_fn is not None and stage != 3:
            raise ValueError("init_fn (materialising a meta-device model) needs stage = 3")
        if meta and init_fn is None:
            raise ValueError("the model has meta-device parameters: pass init_fn (stage 3 materialises them)")
        if broadcast_parameters and topology.grad_group is not None and not meta:
            self._broadcast(named)
        if stage == 3:
            modules = dict(model.named_modules())
            units = default_units(model) if units is None else [modules[u] if isinstance(u, str) else u
                                                                  for u in units]
        self.zero = build_zero(stage, model, named, topology, lr=lr, betas=betas, eps=eps,
                               weight_decay=weight_decay, bucket_elements=bucket_elements, offload=offload,
                               units=units or (), init_fn=init_fn, shard_group=shard_group, hpz=hpz,
                               quantized_weights=quantized_weights, quantized_gradients=quantized_gradients,
                               fp8_all_gather=fp8_all_gather)
        self.optimizer, self.comm = self.zero.optimizer, self.zero.comm
        if stage == 3:
            self._retie()  # a tied alias still points at the meta parameter its first name replaced

    # ---- the training loop ---------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, last: bool | None = None) -> None:
        """Backward of loss / grad_accum (x the loss scale). `last` marks the accumulation boundary explicitly;
        by default it is every grad_accum-th call. ZeRO-2/3 reduce-scatter gradients during this backward."""
        if last is None:
            last = self._micro + 1 == self.grad_accum
        self.zero.begin_micro_batch(last=last)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        (loss * (scale / self.grad_accum)).backward()
        self._micro += 1
        if last:
            self._micro, self._boundary = 0, True

    def is_accumulation_boundary(self) -> bool:
        return self._boundary

    def step(self) -> float | None:
        """At the accumulation boundary: finish the gradient reduction, (unscale,) norm, clip, AdamW, re-gather;
        returns the pre-clip global gradient norm (NaN for a step skipped on fp16 overflow). Between
        boundaries: nothing, returns None."""
        if not self._boundary:
            return None
        self._boundary = False
        lr = self.lr_schedule(self.step_count) if self.lr_schedule is not None else self.lr
        outcome = optimizer_step(self.zero, lr=lr, grad_clip=self.grad_clip, device=self.topo.device,
                                 scaler=self.loss_scaler)
        if outcome.skipped:  # every rank agreed: the step was dropped, parameters untouched
            self.skipped_steps += 1
            return float("nan")
        self.step_count += 1
        return outcome.grad_norm.item()

    # ---- full weights and accounting -----------------------------------------------------------------------
    def gathered(self):
        """Context in which every parameter is full on this rank (stage 3 gathers, then frees again)."""
        return self.zero.gathered()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict (tied names included, so load_state_dict works) with full, unsharded
        parameters: gathered over dp under stage 3 and over tp for tensor-parallel layers. Collective."""
        with self.gathered():
            return full_state_dict(self.module, self.topo.tp_group)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states right now."""
        return self.zero.memory_bytes()

    # ---- internals -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _broadcast(self, named) -> None:
        """dp rank 0's parameters and buffers on every dp rank, as DDP does: the same start whatever each rank
        seeded (ZeRO's update is only correct when the replicas agree). Collective: broadcast over dp."""
        for t in [p for _, p, _ in named] + list(self.module.buffers()):
            dist.broadcast(t.data, group=self.topo.grad_group, group_src=0)

    def _retie(self) -> None:
        """Point every alias of a tied parameter at the (possibly newly materialised) first one."""
        for alias, name in self.aliases.items():
            owner, _, attr = alias.rpartition(".")
            target, module = self.module.get_parameter(name), self.module.get_submodule(owner)
            if getattr(module, attr) is not target:
                setattr(module, attr, target)

