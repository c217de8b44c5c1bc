"""Does a layout fit a GPU? Model states + activations + buffers per device, against the GPU's memory.

    model states  what megazoo's ZeRO optimizers hold (recipes/planner/zero.py's megazoo_state_memory, tested
                  equal to their memory_bytes()): bf16/fp16 stage 0 16 B/param (fp32 storage under autocast),
                  stage 1 2 + 2 + 16/N, stage 2 2 + 16/N, stage 3 18/N (the owned gradient is fp32: 4/N where the
                  paper counts 2/N); with `paper=True` (`megazoo plan --paper`) the ZeRO paper's Table 1 instead
                  (model_state_memory: 16, 4 + 12/N, 2 + 14/N, 16/N). Each pipeline stage's exact parameter count
                  on one tp rank (recipes/planner/shards.py's shard_parameters); N = dp x cp.
    activations   recipes/planner/activations.py (Korthikanti et al. 2022), the schedule's in-flight micro-batches
    buffers       gradient reduce bucket (+ the all-gather bucket at ZeRO 1-2; stage-3 prefetch and persistent
                  parameters) at the recipe's zero.reduce_bucket_size, planner's buffer_memory

Every pipeline stage is summed on its own and the largest total is the device's. Capacity is the GPU's memory in
the planner's GB (1e9 bytes): a "32 GB" V100 has 32 GiB = 34.4e9 bytes, so ~2.4e9 bytes stay for the CUDA
context, the allocator's fragmentation and temporaries that outlive no op (not modelled).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from megazoo.models.config import ModelConfig
from megazoo.models.layout import EXPERT_PARAMETERS
from megazoo.recipes.planner.zero import (FP32_ADAM, GB, MIXED_ADAM, BufferConfig, ModelStateMemory, PlanError,
                                           StateBytes, buffer_memory, megazoo_state_memory, model_state_memory)
from megazoo.models.lora.config import LoRAConfig
from megazoo.recipes.gpus import GPU, GPUS
from megazoo.recipes.planner.links import fp8_gather_buffer
from megazoo.recipes.planner.lora import lora_state_memory, stage_adapters
from megazoo.recipes.planner.activations import ActivationSpec, StageActivations, stage_activations
from megazoo.parallel.pipeline.schedules import placement
from megazoo.recipes.planner.shards import shard_parameters


# The paper's bytes per parameter (--paper) and the activation element size, by recipe precision.
PRECISION_BYTES = {"fp16": (MIXED_ADAM, 2), "bf16": (MIXED_ADAM, 2), "auto": (MIXED_ADAM, 2),
                   "fp32": (FP32_ADAM, 4), "fp64": (StateBytes(8, 8, 16), 8)}
# megazoo_state_memory's precision: "auto" trains in bf16 on CUDA (recipes/training/model_setup.py), and a fit is for a GPU.
MEGAZOO_PRECISION = {"fp16": "fp16", "bf16": "bf16", "auto": "bf16", "fp32": "fp32", "fp64": "fp64"}
DEFAULT_BUCKET = 1 << 24  # recipes' zero.reduce_bucket_size default (elements)
_shard = lru_cache(maxsize=512)(shard_parameters)  # the search asks for the same (cfg, tp, pp) many times


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    seq_len: int = 1024
    checkpointing: bool = False
    offload: bool = False
    schedule: str = "1f1b"
    virtual: int = 1
    stage_layers: tuple[tuple[int, ...], ...] | None = None  # blocks per (virtual) stage; None: uniform
    precision: str = "fp16"
    bucket: int = DEFAULT_BUCKET
    flash_attention: bool = False
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    sequence_parallel: bool = False  # norm / dropout regions split over tp (activations.py)
    lora: LoRAConfig | None = None  # LoRA: only the adapters have gradients and optimizer states
    sharding: str = "flat"  # ZeRO over all dp ranks | "hsdp" (inside a node) | "hpz" (stage 3): planner/links.py
    node_size: int = 0  # GPUs per node (HSDP / hpZ); 0: one node
    quantized_weights: bool = False  # ZeRO++ qwZ (stage 3): int8 parameter gathers (links.link_bytes)
    quantized_gradients: str = "none"  # ZeRO++ qgZ: "int8" | "int4" hierarchical gradient reduce
    fp8_all_gather: bool = False  # stage 3: the FP8 linears' weights gathered as float8 (links.link_bytes)
    fp8: str = "none"  # train.fp8: the blocks' linears in FP8 (activations.fp8_workspace)
    packed: bool = False  # SFT rows packing several examples (activations.ActivationSpec.packed)
    ep: int = 1  # expert parallelism: routed experts split over ep of the dp x cp ranks (expert_split_states)
    fused_ce: bool = True  # the fused cross-entropy (training's `auto`): no fp32 copy of the logits (activations.py)
    fused_loss: bool = False  # the head + loss fused (train.fused_loss): no logits kept (activations.py)
    replica_groups: int = 1  # [fault_tolerance]: dp cut into torchft replica groups; ZeRO shards inside a group

    @property
    def dp_per_node(self) -> int:
        """dp ranks of one (pp, tp) position on a node (ranks fill nodes tp-innermost, as the Topology)."""
        return min(self.dp, self.node_size // (self.tp * self.cp)) if self.node_size else self.dp

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.grad_accum

    def describe(self) -> str:
        extras = (", activation checkpointing" if self.checkpointing else "") + (
            ", optimizer offloaded to CPU" if self.offload else "") + (", flash attention" if self.flash_attention
                                                                        else "") + (
            ", sequence parallel" if self.sequence_parallel else "")
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        cp += f" (experts over ep={self.ep})" if self.ep > 1 else ""
        return (f"dp={self.dp} x tp={self.tp} x pp={self.pp}{cp} = {self.gpus} GPUs, ZeRO-{self.zero}, micro-batch "
                f"{self.micro_batch} x grad_accum {self.grad_accum} x dp = batch {self.global_batch}, seq "
                f"{self.seq_len}, {self.precision}{extras}")


@dataclass(frozen=True)
class DeviceMemory:
    """One device's bytes on the pipeline stage that needs the most."""
    layout: Layout
    pp_rank: int
    psi: int  # parameters on this device before ZeRO
    model_states: float
    activations: float
    buffers: float
    capacity: float
    stage: StageActivations
    states: ModelStateMemory | None = None  # the model-state breakdown behind model_states
    paper: bool = False  # model states by the ZeRO paper's formulas instead of megazoo's optimizers' bytes

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def lines(self) -> list[str]:
        g = lambda x: f"{x / GB:.2f} GB"  # noqa: E731
        st = self.stage
        act = (f"{st.in_flight:g} micro-batch(es) in flight ({self.layout.schedule}'s action list) of "
               f"{st.layers} layers x {st.layer_bytes / GB:.3f} GB"
               f"{' checkpointed input' if self.layout.checkpointing else ''} + {st.extra_bytes / GB:.3f} GB "
               f"embedding/head/stage output" + (f", {st.waiting_bytes / GB:.3f} GB of it waiting for W"
                                                 if st.waiting_bytes else "")
               + f" + {st.workspace_bytes / GB:.3f} GB backward workspace"
               + (f" + {st.recompute_bytes / GB:.3f} GB one layer recomputed" if st.recompute_bytes else ""))
        return [f"fits: {'yes' if self.fits else 'no'} ({g(self.total)} of {g(self.capacity)} per device)",
                f"  layout: {self.layout.describe()}",
                f"  peak pipeline stage: {self.pp_rank} of {self.layout.pp}; Psi = {self.psi:,} parameters",
                f"  model states: {g(self.model_states)} ({self._states_detail()})",
                f"  activations:  {g(self.activations)} = {act}",
                f"  buffers:      {g(self.buffers)} (reduce/all-gather buckets of {self.layout.bucket:,} elements)",
                f"  total:        {g(self.total)} vs capacity {g(self.capacity)} "
                f"({'headroom' if self.fits else 'over by'} {g(abs(self.capacity - self.total))})"]

    def _states_detail(self) -> str:
        m, z = self.states, self.layout.zero
        parts = "" if m is None else (f"params {m.params_bytes / GB:.2f} + grads "
                                      f"{(m.grads_bytes - m.host_grads_bytes) / GB:.2f} + optimizer "
                                      f"{0.0 if m.offload else m.optimizer_bytes / GB:.2f} GB; ")
        where = "CPU-offloaded states excluded" if self.layout.offload else "on the device"
        if self.paper:
            return f"{parts}the ZeRO paper's formulas at ZeRO-{z}, {where}"
        return f"{parts}what megazoo's ZeRO-{z} optimizer holds, {where}; the ZeRO paper's bytes: --paper"


def state_memory(psi: int, layout: Layout, *, paper: bool = False) -> ModelStateMemory:
    """Model states of `psi` parameters per device under `layout`, partitioned over dp x cp (cp ranks hold the
    same parameters): megazoo's optimizers' bytes, or with `paper` the ZeRO paper's (planner.py owns both)."""
    in_node = layout.dp_per_node * layout.cp  # a node's dp x cp ranks (cp ranks hold the same parameters)
    # HSDP: inside a node; fault-tolerant replica groups: inside a group (each group holds every state once)
    n = in_node if layout.sharding == "hsdp" else layout.dp * layout.cp // layout.replica_groups
    if paper:
        mem = model_state_memory(psi, n, layout.zero, PRECISION_BYTES[layout.precision][0], offload=layout.offload)
    else:
        mem = megazoo_state_memory(psi, n, layout.zero, MEGAZOO_PRECISION[layout.precision], offload=layout.offload)
    if layout.sharding == "hpz":  # + the secondary copy of the node's share of the parameters
        mem = replace(mem, params_bytes=mem.params_bytes + psi / in_node
                      * PRECISION_BYTES[layout.precision][0].params)
    return mem


def expert_split_states(dense: int, experts: int, layout: Layout, *, paper: bool = False) -> ModelStateMemory:
    """Model states under expert parallelism (parallel/expert/zero.py): the `dense` parameters partitioned over
    dp x cp as without experts, this rank's `experts` (its stage's routed-expert parameters / ep) over their
    expert-data-parallel group of (dp x cp) / ep ranks."""
    d = state_memory(dense, layout, paper=paper)
    e = state_memory(experts, replace(layout, dp=layout.dp * layout.cp // layout.ep, cp=1), paper=paper)
    return replace(d, psi=dense + experts, params_bytes=d.params_bytes + e.params_bytes,
                   grads_bytes=d.grads_bytes + e.grads_bytes, optimizer_bytes=d.optimizer_bytes + e.optimizer_bytes,
                   host_grads_bytes=d.host_grads_bytes + e.host_grads_bytes)


def activation_spec(cfg: ModelConfig, layout: Layout, mask_bytes: int = 1,
                    flash_attention: bool | None = None) -> ActivationSpec:
    """How `layout` stores activations. ZeRO-0 keeps fp32 parameters and runs bf16/fp16 as torch autocast
    (recipes/model_setup.parameter_dtype): a fp32 residual stream and 16-bit weight casts (recipes/planner/activations.py)."""
    flash = layout.flash_attention if flash_attention is None else flash_attention
    return ActivationSpec.for_model(cfg, PRECISION_BYTES[layout.precision][1], mask_bytes, flash,
                                    autocast_fp32_params=layout.zero == 0, packed=layout.packed,
                                    fused_ce=layout.fused_ce, ep=layout.ep, fp8=layout.fp8)


def layout_activations(cfg: ModelConfig, layout: Layout, shard, spec: ActivationSpec) -> list[StageActivations]:
    """Every pipeline rank's activations under `layout`'s schedule, its virtual stages' own blocks."""
    chunks = [len(x) for x in layout.stage_layers] if layout.stage_layers is not None else None
    return stage_activations(cfg, layout.seq_len, layout.micro_batch, layout.tp,
                             [len(st.layers) for st in shard.stages], checkpointing=layout.checkpointing,
                             micro_batches=layout.grad_accum, schedule=layout.schedule, virtual=layout.virtual,
                             spec=spec, cp=layout.cp, sequence_parallel=layout.sequence_parallel,
                             head_trained=layout.lora is None,
                             chunk_layers=chunks, fused_loss=layout.fused_loss)


def stage_states(cfg: ModelConfig, layout: Layout, st, *, paper: bool = False) -> tuple[int, ModelStateMemory, float]:
    """(parameters on the device before ZeRO, model states, ZeRO buffer bytes) of pipeline stage `st`
    (recipes/planner/shards.py): with expert parallelism this rank's 1/ep of the routed experts, their states over
    the expert-data-parallel group; with LoRA the adapters' states over the frozen base."""
    state = PRECISION_BYTES[layout.precision][0]
    buffers_cfg = BufferConfig(layout.bucket, layout.bucket)
    experts = sum(t.numel for t in st.tensors if t.name.endswith(EXPERT_PARAMETERS)) if layout.ep > 1 else 0
    local = st.numel - experts + experts // layout.ep  # expert parallelism: this rank's share of the experts
    trained = local  # what has gradients: with LoRA only the adapters (the base is frozen, st.numel)
    if layout.lora is not None:
        trained = stage_adapters(cfg, layout.lora, layout.tp, len(st.layers))
        states = lora_state_memory(local, trained, layout.dp * layout.cp, layout.zero,
                                   MEGAZOO_PRECISION[layout.precision], offload=layout.offload)
    elif experts:
        states = expert_split_states(st.numel - experts, experts // layout.ep, layout, paper=paper)
    else:
        states = state_memory(st.numel, layout, paper=paper)
    buf = buffer_memory(local if layout.zero == 3 else trained, layout.zero, buffers_cfg,
                        element_bytes=state.params,
                        persistent_elements=st.persistent_elements(buffers_cfg.persistence_threshold)).total_bytes
    if layout.fp8_all_gather:  # one block's FP8 weights gathered at 1 byte (links.fp8_gather_buffer)
        buf += fp8_gather_buffer(st.tensors)
    return local, states, buf


def device_memory(cfg: ModelConfig, layout: Layout, capacity_gb: float, *, mask_bytes: int = 1,
                  paper: bool = False) -> DeviceMemory:
    """Per-device memory of `cfg` trained under `layout`, on its fullest pipeline stage; model states as
    megazoo's optimizers hold them, or with `paper` by the ZeRO paper's formulas (state_memory)."""
    if layout.precision not in PRECISION_BYTES:
        raise PlanError(f"precision {layout.precision!r} is invalid; valid: {', '.join(PRECISION_BYTES)}")
    if layout.zero == 3 and layout.pp > 1:
        raise PlanError("zero stage 3 with pp > 1 is not supported by megazoo; valid with pp > 1: 0, 1, 2")
    shard = _shard(cfg, layout.tp, layout.pp, layout.stage_layers, placement(layout.schedule))
    spec = activation_spec(cfg, layout, mask_bytes)
    acts = layout_activations(cfg, layout, shard, spec)
    best = None
    for st, act in zip(shard.stages, acts):
        local, states, buf = stage_states(cfg, layout, st, paper=paper)
        row = DeviceMemory(layout, st.pp_rank, local, states.device_bytes, act.peak_bytes, buf, capacity_gb * GB,
                           act, states, paper)
        if best is None or row.total > best.total:
            best = row
    return best


def max_micro_batch(cfg: ModelConfig, layout: Layout, capacity_gb: float, *, limit: int = 4096,
                    divides: int | None = None, **kwargs) -> int:
    """The largest micro-batch (optionally a divisor of `divides`) at which `layout` fits; 0 when none does.
    Memory grows with the micro-batch, so a doubling search then bisection finds it."""
    def ok(b: int) -> bool:
        return device_memory(cfg, replace(layout, micro_batch=b), capacity_gb, **kwargs).fits
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    if divides is not None:
        while divides % lo:
            lo -= 1
    return lo


def recipe_layout(resolved, fused_loss: bool | None = None) -> Layout:
    """The Layout a resolved recipe (recipes/resolve.py's Resolved) trains with (`fused_loss`: that choice instead of
    the recipe's, for Resolved.fused_loss's "auto")."""
    r = resolved.recipe
    par, train, zero = r.parallel, r.train, r.zero
    return Layout(par.dp, par.tp, par.pp, zero.stage, train.micro_batch, train.grad_accum, train.seq_len,
                  train.activation_checkpointing, zero.offload == "cpu", par.schedule, par.virtual_stages,
                  tuple(tuple(x) for x in resolved.stage_layers), train.precision, zero.reduce_bucket_size,
                  r.kernels.attention in ("", "torch", "recompute"),  # SDPA and "recompute": no scores kept
                  cp=par.cp, sequence_parallel=par.sequence_parallel, lora=r.lora if r.lora.enabled else None,
                  sharding="hsdp" if zero.shard_group == "node" else "hpz" if zero.hpz else "flat",
                  node_size=par.node_size, quantized_weights=zero.quantized_weights,
                  quantized_gradients=zero.quantized_gradients,
                  fp8_all_gather=zero.fp8_all_gather, fp8=train.fp8, packed=bool(r.sft.path) and r.sft.packing,
                  ep=par.ep, fused_ce=fused_ce(r.kernels), fused_loss=resolved.fused_loss if fused_loss is None else fused_loss,
                  replica_groups=r.fault_tolerance.replica_groups if r.fault_tolerance.enabled else 1)


def heal_bytes(mem: DeviceMemory) -> float:
    """One rank's heal in flight (parallel/fault_tolerance/replica.HealState): a full copy of the state a restarted
    replica group receives from a live one: parameters, fp32 masters and Adam moments (no gradients). torchft's
    HTTP transport holds it in host memory on both ends (the sender copies its device tensors to the host, the
    receiver loads them there and copies each into its own device buffer), so it needs host, not device, memory."""
    return mem.states.params_bytes + mem.states.optimizer_bytes if mem.states is not None else mem.model_states


def fused_ce(kernels) -> bool:
    """Whether a recipe's [kernels] run a fused cross-entropy: every choice but the reference (kernels.cross_entropy,
    or kernels.prefer where that is unset; apex has none, so `auto` picks a fused one)."""
    return (kernels.cross_entropy or kernels.prefer) != "reference"


def parse_gpu(text: str) -> tuple[float, GPU | None]:
    """'32' (GB) or a named GPU ('v100-32gb', ...) -> (capacity GB, the GPU when named)."""
    key = text.strip().lower()
    if key in GPUS:
        return GPUS[key].memory_gb, GPUS[key]
    try:
        value = float(key)
    except ValueError:
        raise PlanError(f"--gpu-memory {text!r} is neither a number of GB nor a GPU; valid GPUs: "
                        f"{', '.join(GPUS)}") from None
    if not value > 0:
        raise PlanError(f"--gpu-memory {text} is invalid: it must be > 0 GB")
    return value, None


FUSED_LOSS_MIN_SAVING = 1 << 28  # bytes: below 256 MiB "auto" keeps the plain head + loss (fit.fused_loss_saves)


def fused_loss_saves(resolved) -> bool:
    """Whether the fused head + loss (train.fused_loss) lowers the planner's activation peak of the rank that holds
    the head (the other ranks are the same either way) by FUSED_LOSS_MIN_SAVING or more: train.fused_loss = "auto"
    takes it then. The floor is a policy, not a correction: a smaller saving changes no fit on any GPU, and the
    plain path is the one the small recipes and most measurements run."""
    cfg = resolved.model
    peaks = []
    for fused in (False, True):
        layout = recipe_layout(resolved, fused_loss=fused)
        shard = _shard(cfg, layout.tp, layout.pp, layout.stage_layers, placement(layout.schedule))
        try:
            acts = layout_activations(cfg, layout, shard, activation_spec(cfg, layout))
        except PlanError:  # a layout the planner cannot walk: the plain path, which needs no plan
            return False
        peaks.append(sum(a.peak_bytes for a in acts))
    return peaks[0] - peaks[1] >= FUSED_LOSS_MIN_SAVING
