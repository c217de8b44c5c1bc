"""`megazoo plan --recipe R.toml --dry-run`: the real training step, as rank r of the recipe's full world size,
on one CPU with a fake process group and fake tensors (parallel/simulation/fake_world.py).

The job is set up exactly as `megazoo train` sets it up: the same Topology (over the fake group), the same
Trainer (recipes/training/trainer.py: build_model, build_optimizer, the PipelineEngine and its schedule, the precision
and loss scaler), and one whole `Trainer.train_step`: every micro-batch through the schedule, the reductions,
`optimizer_step` and the parameter gathers. Nothing is modelled a second time; what differs from training:
- the data: fake token batches of the recipe's shape (micro_batch x seq_len + 1), not the corpus;
- host reads: fake tensors hold no values, so a read (`.item()` / `.tolist()`) returns a placeholder 0 at that
  point and the report names each place (the fp16 overflow verdict: "no overflow"; the step's metrics);
- the device is the CPU: kernels are the CPU's, sizes and dtypes are the recipe's. One kernel is swapped so
  that it keeps what the GPU's keeps (`gpu_kernels`; the report notes it): with attention dropout, CPU SDPA runs
  its math path, which stores the (b, h, s, s) attention probabilities; FlashAttention on a GPU keeps q, k, v,
  the output and a log-sum-exp, so the dry run runs kernels.attention = "recompute" (the same SDPA, recomputed
  in backward; kernels/recompute_attention.py) instead.

One rank per role (`roles`): every pipeline stage that can differ (first, one middle stage, last) at dp rank 0
and tp rank 0. dp ranks hold equal partitions (every ZeRO bucket is padded to a multiple of dp) and tp ranks
equal shards (the vocabulary is padded to 128 x tp), so one rank stands for its whole stage. Measurement per
role: peak bytes by category (MemoryTracker), each collective summed per (op, group size) (StepRecorder) and the
step's FLOPs (FlopCounterMode); recipes/dry_run/report.py puts the planner's numbers beside them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from megazoo.parallel.checkpoint.views import ensure_adam_state
from megazoo.parallel.simulation.fake_world import (MemoryTracker, StepRecorder, fake_process_group, fake_tensors,
                                         flop_counter)
from megazoo.parallel.topology import Topology
from megazoo.recipes.catalog import find_recipe, stated_gpu  # noqa: F401 (stated_gpu: read from here too)
from megazoo.recipes.config import load_recipe
from megazoo.recipes.training.data_setup import TrainData
from megazoo.recipes.resolve import Resolved, resolve_for_planning


@dataclass(frozen=True)
class Role:
    rank: int  # the global rank that runs
    pp_stage: int
    ranks: tuple[int, ...]  # every rank it stands for
    why: str


@dataclass
class StepMeasurement:
    """What one rank's step used and sent (fake or real: the same code measures both)."""

    peak: dict[str, int]  # bytes by category at the device peak, and "total"
    host_bytes: int  # offloaded optimizer state (ZeRO-Offload) at that moment: CPU memory, not the device's
    collectives: list[dict]  # {"op", "group_size", "count", "bytes"}, summed over the step
    trace: list[tuple[str, int, int]]  # every collective in order: (op, group size, bytes)
    flops: int
    host_reads: dict[str, int] = field(default_factory=dict)  # call site -> placeholder reads (dry run only)
    by_group: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (op, "mesh_dp"...) -> count, bytes
    copies: dict[str, list[int]] = field(default_factory=dict)  # host <-> device: [count, bytes, blocking count]
    # ZeRO's ring bytes per link class ("intra" / "inter" node; parallel/collectives.CommLedger) when the recipe
    # says parallel.node_size: what recipes/planner/links.py's link_volume predicts
    link_bytes: dict[str, float] = field(default_factory=dict)


@dataclass
class RoleResult:
    role: Role
    measured: StepMeasurement
    seconds: float


class ShapedSamples:
    """Token samples of the right shape and no content (zeros): the dry run reads no corpus. Created inside the
    fake mode they are fake; in a real run they are real zeros (a valid, if dull, batch)."""

    def __init__(self, count: int, seq_len: int):
        self.count, self.seq_len = count, seq_len

    def __len__(self) -> int:
        return self.count

    def stack(self, indices) -> torch.Tensor:
        return torch.zeros((len(indices), self.seq_len + 1), dtype=torch.long)


def shaped_data(res: Resolved) -> TrainData:
    return TrainData(ShapedSamples(res.global_batch, res.recipe.train.seq_len), None)


def load(path: str | Path, overrides=()) -> Resolved:
    """The recipe (a file, or a shipped recipe's name) resolved as planning reads it: recipes/resolve.py's
    resolve_for_planning (its corpus, tokenizer and checkpoint need not exist)."""
    return resolve_for_planning(load_recipe(find_recipe(str(path)), list(overrides)))


def pipeline_depth_overrides(res: Resolved) -> list[str]:
    """`--set` overrides that run a pipeline recipe's step with fewer micro-batches ([] when none are fewer): the
    fewest with which every rank reaches the same peak of live micro-batches as the recipe's own count, walked on
    the schedule's action lists (recipes/planner/schedule_memory.py's enough_micro_batches: pp under 1F1B and
    ZB-H1, more for the interleaved and V schedules, all of them under GPipe). No stage's peak grows with the
    micro-batches of a step beyond that (tests/recipes/planner/test_dry_run.py), so the peak is the whole step's; ZeRO's dp
    traffic is per step, p2p bytes and FLOPs scale with the count. gpt-1t's 1,536 micro-batches: 25."""
    from megazoo.recipes.planner.schedule_memory import enough_micro_batches

    par, train = res.recipe.parallel, res.recipe.train
    if par.pp == 1:
        return []
    fewer = enough_micro_batches(par.schedule, train.grad_accum, par.pp, par.virtual_stages)
    if fewer >= train.grad_accum:
        return []
    return [f"train.grad_accum={fewer}", f"train.global_batch={train.micro_batch * fewer * par.dp}"]


def gpu_kernels(res: Resolved) -> tuple[Resolved, list[str]]:
    """The recipe as the dry run runs it on the CPU, and one note per kernel swapped for the GPU's behaviour.

    Attention: where the recipe runs SDPA (FlashAttention / memory-efficient on its GPU) with attention dropout,
    CPU SDPA takes its math path and keeps scores, probabilities and mask for backward (~1.3 GB per layer for
    gpt2-1.5b), which the GPU does not; "recompute" keeps q, k, v only, as the GPU's kernel does (less its output,
    which the output projection keeps anyway, and its log-sum-exp). Without dropout the CPU's own fused SDPA
    already keeps what the GPU's keeps: nothing is swapped."""
    from megazoo.kernels.dispatch import resolve_op

    kernels = res.recipe.kernels
    sdpa = resolve_op("attention", kernels.choice(), torch.device("cpu")).name == "torch"
    if res.model.attention != "dense" or res.model.attn_dropout == 0.0 or not sdpa:
        return res, []
    note = ("attention runs kernels.attention = \"recompute\" in place of SDPA: with attention dropout the CPU's "
            "SDPA keeps the (b, h, s, s) probabilities for backward, the GPU's FlashAttention keeps q, k, v, the "
            "output and a log-sum-exp; \"recompute\" keeps q, k, v (its FLOPs: + the attention core's forward, "
            "again in backward)")
    return replace(res, recipe=replace(res.recipe, kernels=replace(kernels, attention="recompute"))), [note]


def attention_recomputed(res: Resolved) -> bool:
    """Whether the dry run's attention is "recompute" (swapped in by gpu_kernels, or the recipe's own): it keeps
    no scores, and runs the attention core's forward once more in backward."""
    return res.model.attention == "dense" and gpu_kernels(res)[0].recipe.kernels.attention == "recompute"


def _global_rank(res: Resolved, pp_rank: int, dp_rank: int = 0, cp_rank: int = 0, tp_rank: int = 0) -> int:
    """The global rank at mesh coordinate (pp, dp, cp, tp), as Topology.of lays the recipe's [parallel] out."""
    return Topology.rank_at(res.recipe.parallel, pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank)


def roles(res: Resolved) -> list[Role]:
    """The first stage, the last stage and one middle stage (pp > 2): the middle stage with the most blocks,
    the earliest among equals, which under 1F1B also keeps the most micro-batches in flight (pp - stage).
    Each role runs at dp, cp and tp rank 0 and stands for its stages' ranks at every (dp, cp, tp): cp ranks hold
    the same parameters and two load-balanced chunks of s / (2 cp) tokens each (parallel/context), so equal
    activations, and send equal ring / all-to-all bytes."""
    par = res.recipe.parallel
    stage_ranks = lambda s: tuple(_global_rank(res, s, d, c, t) for d in range(par.dp)  # noqa: E731
                                  for c in range(par.cp) for t in range(par.tp))
    if par.pp == 1:
        return [Role(0, 0, stage_ranks(0), "every rank: equal dp partitions, cp chunks and tp shards")]
    from megazoo.parallel.pipeline.partition import rank_chunks
    from megazoo.parallel.pipeline.schedules import placement

    v = placement(par.schedule) == "v"  # zbv / dualpipev: rank 0 holds the first and the last stage
    blocks = [sum(len(res.stage_layers[c]) for c in rank_chunks(res.stage_layers, par.pp, s, placement(par.schedule)))
              for s in range(par.pp)]
    out = [Role(0, 0, stage_ranks(0), "first and last stage (V placement): embedding, head and loss" if v
                else "first stage: embedding, most micro-batches in flight")]
    if par.pp > 2:
        mid = max(range(1, par.pp - 1), key=lambda s: (blocks[s], -s))
        ranks = tuple(r for s in range(1, par.pp - 1) for r in stage_ranks(s))
        out.append(Role(_global_rank(res, mid), mid, ranks,
                        f"middle stages 1..{par.pp - 2}: stage {mid} has the most blocks ({blocks[mid]}) and, "
                        f"under 1F1B, the most micro-batches in flight of them"))
    out.append(Role(_global_rank(res, par.pp - 1), par.pp - 1, stage_ranks(par.pp - 1),
                    "the bottom of the V: two middle stages, the turn handed over in memory" if v
                    else "last stage: final norm, head and loss"))
    return out


def measure_step(build: Callable[[], object], *, offload: bool, placeholders: bool) -> StepMeasurement:
    """Build a Trainer with `build()` and run its step 0 under the memory tracker, the collective recorder and
    the FLOP counter. Used by the dry run (fake tensors, placeholders for host reads) and by the tests' real
    gloo runs (real tensors), so both are measured alike. The peak counts everything created from the build on.
    With ZeRO-Offload the fp32 masters, their gradients and the Adam moments live in CPU memory: they are
    labelled optimizer state and left out of the device peak (reported as host_bytes).
    The step is measured as every step after the first: torch's AdamW creates its moments in the first
    optimizer step, after that step's backward, so they are created before it (ensure_adam_state, as a checkpoint
    load does); step 0 alone would leave 8 bytes per owned parameter out of the backward peak (megatron-8.3b,
    ZeRO-0: 8.3 GB). ZeRO-3's owned gradients, created by the step's reductions, are labelled as they appear."""
    with MemoryTracker(exclude_optimizer=offload) as mem:
        trainer = build()
        zero = trainer.zero
        if hasattr(zero, "spare"):  # ZeRO-3's CPU-only reuse of freed gathers moves memory between storages
            zero.spare.limit = 0  # (_swap_data_ptr_), which the tracker cannot see; CUDA never parks (spare.py)
        masters = [p for g in zero.optimizer.param_groups for p in g["params"]]
        # per torch optimizer: expert parallelism's joint optimizer (parallel/expert/zero.py) hands out a merged
        # copy of its halves' states, into which the moments would be written and lost
        for opt in getattr(zero.optimizer, "optimizers", (zero.optimizer,)):
            ensure_adam_state(opt, [p for g in opt.param_groups for p in g["params"]])
        moments = [v for state in zero.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        host = masters + moments + ([p.grad for p in masters if p.grad is not None] if offload else [])
        params = [p for chunk in trainer.chunks for p in chunk.parameters()]
        full_grads = [p.grad for p in params if p.grad is not None]  # stage 0/1: views of the flat buckets
        mem.label(params=params, grads=full_grads + ([] if offload else zero.gradients()), optimizer=host,
                  later_grads=None if offload else zero.gradients)
        with StepRecorder(placeholders=placeholders) as rec, flop_counter() as flops:
            trainer.train_step(0)
        device = trainer.topo.device
        if device.type == "cpu":  # one memory: the offloaded states are taken out of it
            peak = mem.peak()
            host_bytes = peak["optimizer"] if offload else 0
            peak["total"] -= host_bytes
        else:  # the GPU's own peak; ZeRO-Offload's host memory (states, staging) at the host's own peak
            peak = mem.peak(device)
            host_bytes = mem.peak(torch.device("cpu"))["total"] if offload else 0
    return StepMeasurement(peak, host_bytes, rec.summary(), rec.trace, flops.get_total_flops(),
                           dict(rec.host_reads), dict(rec.by_group), dict(rec.copies), dict(zero.comm.link_bytes))


def fake_cuda_kernels(res: Resolved) -> tuple[Resolved, list[str]]:
    """The recipe as the dry run runs it on fake CUDA, and a note per op swapped. Our Triton kernels are torch
    ops with fake implementations (kernels/triton_common.py): they run as chosen. apex's kernels are not torch
    ops (its autograd Functions launch on real device memory), so where the recipe's choice resolves to apex on
    CUDA the op runs torch's implementation instead."""
    from megazoo.kernels.dispatch import OPS, resolve_op

    kernels, swapped = res.recipe.kernels, {}
    for op in OPS:
        if op == "adamw" and res.recipe.zero.offload == "cpu":
            continue  # ZeRO-Offload's AdamW runs on the host's fp32 masters
        if resolve_op(op, kernels.choice(), torch.device("cuda")).name == "apex":
            swapped[op] = "apex"
    if not swapped:
        return res, []
    fields = {op: "torch" for op in swapped}
    note = ("fake CUDA runs torch's " + ", ".join(swapped) + " in place of apex's: apex's kernels launch on real "
            "device memory (they are not torch ops with fake implementations)")
    return replace(res, recipe=replace(res.recipe, kernels=replace(kernels, **fields))), [note]


class RoleFailed(RuntimeError):
    """One role's fake step raised: the message names the role, the cause is chained."""


def run_role(res: Resolved, role: Role, device: str = "cpu") -> RoleResult:
    """One role's whole training step in a fake world of the recipe's size, on fake `device` tensors ("cuda":
    only in a process with the fake CUDA shim, recipes/dry_run/cuda.py)."""
    from megazoo.recipes.training.trainer import Trainer

    par = res.recipe.parallel
    start = time.perf_counter()
    res, _ = gpu_kernels(res)  # the kernels that keep what the GPU's keep
    if device == "cuda":
        res, _ = fake_cuda_kernels(res)
    try:
        with fake_process_group(role.rank, res.world_size):
            topo = Topology.of(par, device)  # the mapping `megazoo train` uses: (pp, dp, cp, tp)
            with fake_tensors():
                measured = measure_step(lambda: Trainer(res, topo, shaped_data(res)),
                                        offload=res.recipe.zero.offload == "cpu", placeholders=True)
    except Exception as err:  # say which role failed and how, then let the error through
        raise RoleFailed(f"dry run of rank {role.rank} (pipeline stage {role.pp_stage}, {role.why}) failed: "
                         f"{type(err).__name__}: {err}") from err
    return RoleResult(role, measured, time.perf_counter() - start)


def dry_run(res: Resolved, only: Callable[[Role], bool] | None = None, device: str = "cpu") -> list[RoleResult]:
    return [run_role(res, role, device) for role in roles(res) if only is None or only(role)]
