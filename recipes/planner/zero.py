"""The ZeRO planner: per-device model-state memory and communication volume, by formula, before any process runs.

Pure arithmetic (no torch, no torch.distributed), so a 100B-class layout can be planned on a laptop and the
training code can test what it *measures* against what this file *claims* (DESIGN.md principle 6). Model-agnostic:
it takes a parameter count; counting a GPT preset's parameters per tp/pp shard is recipes/planner/shards.py's job.

Memory (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 5
and Table 1). Psi is the parameter count one device holds before ZeRO (for a model split by tensor and pipeline
parallelism, one tp rank of its largest pipeline stage), N the data-parallel degree, K the optimizer bytes per
parameter. Mixed
precision Adam: 2 bytes fp16/bf16 params + 2 bytes grads + K = 12 (fp32 master copy, momentum, variance):

    stage 0 (baseline)   (2 + 2 + K) Psi
    stage 1 (P_os)        2 Psi + 2 Psi + K Psi / N
    stage 2 (P_os+g)      2 Psi + (2 + K) Psi / N
    stage 3 (P_os+g+p)    (2 + 2 + K) Psi / N

Plain fp32 Adam is the same arithmetic with 4 + 4 + K = 8 (no master copy): `FP32_ADAM`. With offload
(ZeRO-Offload, Ren et al. 2021) the optimizer states live in CPU memory: `device_bytes` drops by exactly them and
`cpu_bytes` holds them. Transient buffers (communication buckets, stage-3 prefetch and persistent parameters) are
reported apart by `buffer_memory`, never added to the paper's model-state numbers. GB means 1e9 bytes.

Communication volume: the number of elements *each rank sends* over the dp group in one optimizer step, with
ring collectives (a reduce-scatter or an all-gather of Psi elements sends Psi (N-1)/N per rank; an all-reduce is
both, 2 Psi (N-1)/N). Bytes = elements x the element size (2 for fp16/bf16, 4 for fp32 training).

    stage 0      all-reduce of the gradients                                      2 Psi (N-1)/N
    stage 1, 2   reduce-scatter of the gradients + all-gather of the new params   2 Psi (N-1)/N
    stage 3      reduce-scatter of the gradients + all-gather of the params in
                 forward + all-gather again in backward                           3 Psi (N-1)/N

With gradient accumulation over `grad_accum` micro-batches: stages 0 and 1 accumulate full local gradients and
reduce once per step; stage 2 reduce-scatters every micro-batch (it keeps only its gradient partition, as
megazoo's stage12.py and DeepSpeed do); stage 3 gathers and reduce-scatters every micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Protocol

GB = 1e9  # the paper's GB: 10^9 bytes
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


class PlanError(ValueError):
    """A plan that cannot exist; the message names the input, the value and what would be valid."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of model state. `optimizer` is the paper's K."""
    params: int = 2
    grads: int = 2
    optimizer: int = 12

    def __post_init__(self):
        for name in ("params", "grads", "optimizer"):
            if getattr(self, name) < 0:
                raise PlanError(f"{name} bytes per parameter = {getattr(self, name)} must be >= 0")


MIXED_ADAM = StateBytes(2, 2, 12)  # fp16/bf16 params and grads; fp32 master + momentum + variance (K = 12)
FP32_ADAM = StateBytes(4, 4, 8)  # fp32 params and grads; momentum + variance only (K = 8, no master copy)


@dataclass(frozen=True)
class ModelStateMemory:
    """Model-state bytes per data-parallel rank for one ZeRO stage (the paper's Table 1 quantities).

    Psi / N is exact division, as in the paper; an implementation pads each partition to whole elements
    (megazoo pads every bucket to a multiple of dp), so measured bytes may exceed these by < dp elements a bucket.
    """
    stage: int
    psi: int
    dp: int
    params_bytes: float  # on the device
    grads_bytes: float  # on the device
    optimizer_bytes: float  # this rank's optimizer states, wherever they live (CPU when offload)
    offload: bool = False
    host_grads_bytes: float = 0.0  # the part of grads_bytes in CPU memory (megazoo's offload: owned fp32 grads)

    @property
    def device_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes - self.host_grads_bytes
                + (0.0 if self.offload else self.optimizer_bytes))

    @property
    def cpu_bytes(self) -> float:
        return (self.optimizer_bytes if self.offload else 0.0) + self.host_grads_bytes

    @property
    def total_bytes(self) -> float:
        """All model states of this rank, device + CPU (equals device_bytes without offload)."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class CommVolume:
    """Elements one rank sends over the dp group per optimizer step, by collective (see the module docstring)."""
    stage: int
    psi: int
    dp: int
    all_reduce_elements: float  # stage 0 only
    reduce_scatter_elements: float  # gradients, stages 1-3
    all_gather_elements: float  # parameters, stages 1-3 (stage 3: forward and backward)
    factor: int  # elements = factor x Psi (N-1)/N: 2 for stages 0-2, 3 for stage 3 (without accumulation)
    grad_bytes: int = 2  # bytes per gradient element sent
    param_bytes: int = 2  # bytes per parameter element sent

    @property
    def elements(self) -> float:
        return self.all_reduce_elements + self.reduce_scatter_elements + self.all_gather_elements

    @property
    def bytes(self) -> float:
        return ((self.all_reduce_elements + self.reduce_scatter_elements) * self.grad_bytes
                + self.all_gather_elements * self.param_bytes)


@dataclass(frozen=True)
class BufferConfig:
    """Transient communication buffers, in elements. Defaults are DeepSpeed's ZeRO defaults (the `--paper`
    planner's); megazoo's own are zero.reduce_bucket_size (2^24 elements by default) and megazoo_buffer_memory."""
    reduce_bucket: int = 500_000_000  # reduce_bucket_size: gradients gathered for one reduce(-scatter)
    allgather_bucket: int = 500_000_000  # allgather_bucket_size (stages 1-2): updated params per all-gather
    prefetch: int = 50_000_000  # stage3_prefetch_bucket_size: gathered params in flight ahead of use
    persistence_threshold: int = 100_000  # stage3_param_persistence_threshold: smaller tensors stay whole


@dataclass(frozen=True)
class BufferMemory:
    """Buffer bytes per rank for one stage: reported apart from (never added to) the model states."""
    stage: int
    reduce_bucket_bytes: float
    allgather_bucket_bytes: float  # stages 1-2
    prefetch_bytes: float  # stage 3
    persistent_bytes: float | None  # stage 3: tensors below the threshold kept whole; None when unknown

    @property
    def total_bytes(self) -> float:
        return (self.reduce_bucket_bytes + self.allgather_bucket_bytes + self.prefetch_bytes
                + (self.persistent_bytes or 0.0))


def _check(stage: int, psi: int, dp: int) -> None:
    if stage not in STAGES:
        raise PlanError(f"zero stage {stage!r} is invalid; valid: 0, 1, 2, 3")
    if not isinstance(dp, int) or dp < 1:
        raise PlanError(f"dp = {dp!r} is invalid: it must be an integer >= 1")
    if psi < 0:
        raise PlanError(f"psi = {psi!r} is invalid: it must be >= 0")


def model_state_memory(psi: int, dp: int, stage: int, state: StateBytes = MIXED_ADAM, *,
                       offload: bool = False) -> ModelStateMemory:
    """The paper's per-device model-state memory of `psi` parameters over `dp` ranks at ZeRO `stage`."""
    _check(stage, psi, dp)
    # Each stage partitions one more kind of state over dp: optimizer (>= 1), gradients (>= 2), params (3).
    params = state.params * psi / (dp if stage >= 3 else 1)
    grads = state.grads * psi / (dp if stage >= 2 else 1)
    optimizer = state.optimizer * psi / (dp if stage >= 1 else 1)
    return ModelStateMemory(stage, psi, dp, params, grads, optimizer, offload)


# ---- megazoo's own model states (the default of `megazoo plan`; the paper's formulas above are `--paper`) ----
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
MAX_REDUCTIONS_IN_FLIGHT = 2  # as parallel/zero/partitioned.py: full-size gradient buckets reducing at once


def storage_bytes(stage: int, precision: str) -> int:
    """Bytes of one parameter (and one gradient) element as megazoo stores it: bf16/fp16 training keeps its
    parameters and gradients in 2 bytes only under ZeRO >= 1 (stage 0 keeps fp32 and computes under autocast)."""
    if precision not in PRECISIONS:
        raise PlanError(f"precision {precision!r} is invalid; valid: {', '.join(PRECISIONS)}")
    if precision == "fp64":
        return 8
    return 4 if precision == "fp32" or stage == 0 else 2


def megazoo_state_memory(psi: int, dp: int, stage: int, precision: str = "bf16", *,
                         offload: bool = False) -> ModelStateMemory:
    """The bytes megazoo's ZeRO optimizers hold per rank between steps (what their memory_bytes() reports), for
    `psi` parameters (each bucket padded to a multiple of dp, as megazoo pads) over `dp` ranks. s = storage
    bytes, m = master bytes (4; 8 in fp64), owned = psi / dp:

        stage 0    params s psi, grads s psi, Adam moments 2m psi                        (4 + 4 + 8 = 16 B)
        stage 1    params s psi, grads s psi (full buffers) + m owned (the fp32 accumulator the reduce-scatter
                   lands in), moments 2m owned, + an fp32 master m owned unless s = m (then the owned chunk
                   of the parameters is its own master: an alias, counted once, in params)
        stage 2    as stage 1 without the full gradient buffers (returned to the pool after each reduction)
        stage 3    as stage 2 with params s owned

    So bf16/fp16: stage 1 2 + 2 + 16/N, stage 2 2 + 16/N, stage 3 18/N bytes per parameter (the owned gradient
    is fp32: 4/N, not the paper's 2/N); fp32: 8 + 12/N, 4 + 12/N, 16/N. Offload ("cpu") moves the masters, the
    moments and the owned fp32 gradients to CPU memory (host_grads_bytes)."""
    _check(stage, psi, dp)
    s, m = storage_bytes(stage, precision), 8 if precision == "fp64" else 4
    if stage == 0:
        if offload:
            raise PlanError("offload needs zero stage >= 1 (only partitioned optimizer states are offloaded)")
        return ModelStateMemory(0, psi, dp, s * psi, s * psi, 2 * m * psi)
    owned = psi / dp
    params = s * (owned if stage == 3 else psi)
    grads = m * owned + (s * psi if stage == 1 else 0.0)
    aliased = s == m and not offload
    optimizer = 2 * m * owned + (0.0 if aliased else m * owned)
    return ModelStateMemory(stage, psi, dp, params, grads, optimizer, offload, m * owned if offload else 0.0)


def megazoo_buffer_memory(psi: int, stage: int, precision: str = "bf16", *, bucket: int = 1 << 24,
                          units: tuple[int, int] | None = None) -> BufferMemory:
    """megazoo's transient buffers during backward, apart from the model states (an estimate, not measured):
    stage 0 reduces views of its gradient buffer and stage 1 reduces from its full gradient buffers (both model
    states: no extra); stage 2 holds up to MAX_REDUCTIONS_IN_FLIGHT reducing buckets and the one filling, each
    min(bucket, Psi) elements; stage 3 holds the root unit (embeddings, final LayerNorm) and two blocks (the one
    running, the one prefetched) gathered, with their full gradients: `units` = (root, largest block)
    elements, None when unknown. All-gathers write in place (no all-gather bucket)."""
    _check(stage, psi, 1)
    s = storage_bytes(stage, precision)
    reduce = (MAX_REDUCTIONS_IN_FLIGHT + 1) * min(bucket, psi) * s if stage == 2 else 0.0
    gathered = None if stage == 3 and units is None else 0.0
    if stage == 3 and units is not None:
        gathered = 2 * (units[0] + 2 * units[1]) * s  # params + their gradients
    return BufferMemory(stage, reduce, 0.0, gathered or 0.0, None if gathered is None else 0.0)


def communication_volume(psi: int, dp: int, stage: int, state: StateBytes = MIXED_ADAM, *,
                         grad_accum: int = 1) -> CommVolume:
    """Elements (and bytes) each rank sends over dp in one optimizer step; ring collectives."""
    _check(stage, psi, dp)
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise PlanError(f"grad_accum = {grad_accum!r} is invalid: it must be an integer >= 1")
    one = psi * (dp - 1) / dp  # one reduce-scatter or one all-gather of psi elements, per rank
    all_reduce = rs = ag = 0.0
    if stage == 0:
        all_reduce = 2 * one
    elif stage == 1:
        rs, ag = one, one
    elif stage == 2:
        rs, ag = grad_accum * one, one  # only the gradient partition survives a micro-batch
    else:
        rs, ag = grad_accum * one, grad_accum * 2 * one  # params gathered for forward and again for backward
    factor = {0: 2, 1: 2, 2: grad_accum + 1, 3: 3 * grad_accum}[stage]
    return CommVolume(stage, psi, dp, all_reduce, rs, ag, factor, state.grads, state.params)


def buffer_memory(psi: int, stage: int, buffers: BufferConfig = BufferConfig(), *, element_bytes: int = 2,
                  persistent_elements: int | None = None) -> BufferMemory:
    """Bucket bytes per rank. A bucket never exceeds the model it buckets, hence min(bucket, psi).

    Stage 0: one all-reduce bucket; stages 1-2: a reduce bucket and an all-gather bucket; stage 3: a reduce
    bucket, the prefetch window and the persistent (never partitioned) small tensors, which need the tensor
    list (`ShardCounts.persistent_elements`) and are None when only a count is known.
    """
    _check(stage, psi, 1)
    reduce = min(buffers.reduce_bucket, psi) * element_bytes
    gather = min(buffers.allgather_bucket, psi) * element_bytes if stage in (1, 2) else 0.0
    prefetch = min(buffers.prefetch, psi) * element_bytes if stage == 3 else 0.0
    persistent = None
    if stage == 3 and persistent_elements is not None:
        persistent = persistent_elements * element_bytes
    return BufferMemory(stage, reduce, gather, prefetch, persistent if stage == 3 else 0.0)


# ---- one plan for every stage ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class StagePlan:
    memory: ModelStateMemory
    comm: CommVolume
    buffers: BufferMemory

    @property
    def stage(self) -> int:
        return self.memory.stage


class ShardCounts(Protocol):
    """What a model-specific count of one device's parameters tells the formulas (recipes/planner/shards.py's ModelShard
    for the GPT presets): the tensor sizes matter only for stage 3's persistent (never partitioned) tensors."""

    @property
    def psi(self) -> int: ...

    def persistent_elements(self, threshold: int) -> int: ...


@dataclass(frozen=True)
class Plan:
    psi: int
    dp: int
    state: StateBytes
    offload: bool
    grad_accum: int
    buffer_config: BufferConfig
    derivation: str  # how psi was obtained
    stages: tuple[StagePlan, ...]
    shard: ShardCounts | None = None  # the model-specific counts psi came from, when a model was given
    precision: str | None = None  # megazoo's own accounting in this precision; None: the paper's formulas


def plan(psi: int, dp: int, stages=STAGES, *, state: StateBytes = MIXED_ADAM, offload: bool = False,
         grad_accum: int = 1, buffers: BufferConfig = BufferConfig(), shard: ShardCounts | None = None,
         derivation: str = "", precision: str | None = None) -> Plan:
    """Memory, communication and buffers for each ZeRO stage in `stages`, for Psi = `psi` over `dp` ranks: the
    paper's formulas with `state` bytes per parameter, or with `precision` megazoo's own (megazoo_state_memory,
    megazoo_buffer_memory with buffers.reduce_bucket, communication in the element sizes megazoo sends)."""
    if precision is not None:
        units = shard.unit_elements() if shard is not None and hasattr(shard, "unit_elements") else None
        rows = []
        for s in stages:
            size = storage_bytes(s, precision)
            rows.append(StagePlan(megazoo_state_memory(psi, dp, s, precision, offload=offload),
                                  communication_volume(psi, dp, s, StateBytes(size, size, 0), grad_accum=grad_accum),
                                  megazoo_buffer_memory(psi, s, precision, bucket=buffers.reduce_bucket,
                                                        units=units)))
        return Plan(psi, dp, state, offload, grad_accum, buffers,
                    derivation or f"Psi = {psi:,} parameters per device (given)", tuple(rows), shard, precision)
    persistent = shard.persistent_elements(buffers.persistence_threshold) if shard else None
    rows = tuple(StagePlan(model_state_memory(psi, dp, s, state, offload=offload),
                           communication_volume(psi, dp, s, state, grad_accum=grad_accum),
                           buffer_memory(psi, s, buffers, element_bytes=state.params,
                                         persistent_elements=persistent)) for s in stages)
    return Plan(psi, dp, state, offload, grad_accum, buffers,
                derivation or f"Psi = {psi:,} parameters per device (given)", rows, shard)


def format_sig(x: float, sig: int = 3) -> str:
    """`x` to `sig` significant figures, half up, no exponent; integers from 10**(sig-1) up print whole.

    120e9 / GB -> "120", 31.40625 -> "31.4", 16.640625 -> "16.6", 1.875 -> "1.88" (the paper's Table 1).
    """
    if x == 0:
        return "0"
    exact = Decimal(repr(float(x)))  # the shortest decimal of the float: 1.875 stays 1.875, then rounds up
    digits = sig - 1 - math.floor(math.log10(abs(x)))
    if digits <= 0:
        return str(int(exact.quantize(Decimal(1), rounding=ROUND_HALF_UP)))
    rounded = exact.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)
    if abs(rounded) >= Decimal(10) ** (sig - digits):  # 9.996 -> 10.00: one digit too many after carrying
        rounded = exact.quantize(Decimal(1).scaleb(-(digits - 1)), rounding=ROUND_HALF_UP)
    return format(rounded, "f")


def format_gb(nbytes: float) -> str:
    return format_sig(nbytes / GB)
