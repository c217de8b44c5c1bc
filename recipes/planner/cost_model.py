"""A stated cost model for ranking layouts, and the search over (dp, tp, pp, ZeRO stage, micro-batch).

Estimated step time = compute + pipeline bubble + tensor-, pipeline- and data-parallel communication, nothing
overlapped (an upper bound on what overlap would give; the ranking, not the absolute time, is the point):

    compute   model FLOPs per token (models/flops.py: 6 x matmul parameters + 12 L s h) x tokens per step,
              x 4/3 with activation checkpointing (the forward runs twice), / (GPUs x peak x MFU)
    bubble    compute x (pp - 1) / (micro-batches x virtual stages)           (1F1B, Narayanan et al. 2021)
    tp        per layer and micro-batch 4 all-reduces of s b h activations (2 forward, 2 backward; 6 with
              recomputation), ring: 2 (t-1)/t x bytes per rank, over the intra-node bandwidth (tp stays in a node)
    pp        per micro-batch one activation forward and one gradient backward across each stage boundary,
              over the inter-node bandwidth once tp x pp spans more than a node
    dp        recipes/planner/zero.py's communication volume of the stage's Psi (stage 2 / 3: per micro-batch),
              over the inter-node bandwidth when the job spans nodes, else intra-node; HSDP and hpZ layouts
              (recipes/planner/links.py) split it into intra-node and inter-node bytes, each at its bandwidth
    ep        per MoE layer and micro-batch 4 all-to-alls (6 with recomputation) of s b k h activations, (ep-1)/ep
              of them leaving the rank (uniform routing: parallel/expert's all_to_all_bytes), intra-node while
              the ep ranks (tp apart) fit in a node; the dp term still counts this rank's experts over all dp
              ranks (they reduce over the (dp x cp) / ep holding them: an overestimate of ep's saving, not of ep)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megazoo.models.config import ModelConfig
from megazoo.models.layout import divisors
from megazoo.recipes.planner.zero import PlanError, communication_volume
from megazoo.recipes.planner.fit import PRECISION_BYTES, DeviceMemory, Layout, device_memory, max_micro_batch
from megazoo.recipes.gpus import GPU
from megazoo.recipes.planner.links import link_volume
from megazoo.models.flops import model_flops_per_token


@dataclass(frozen=True)
class CostModel:
    peak_flops: float  # dense 16-bit FLOP/s per GPU
    mfu: float = 0.4  # the model-FLOPs utilisation the compute term assumes
    intra_node_bw: float = 150e9  # bytes/s per GPU within a node
    inter_node_bw: float = 12.5e9  # bytes/s per GPU across nodes
    per_node: int = 8  # GPUs per node (tp is kept within one)

    @staticmethod
    def for_gpu(gpu: GPU, **overrides) -> "CostModel":
        base = CostModel(gpu.peak_flops, 0.4, gpu.intra_node_bw, gpu.inter_node_bw, gpu.per_node)
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    def describe(self) -> list[str]:
        return [f"cost model: compute = model FLOPs (6 x matmul params + 12 L s h per token; x 4/3 with "
                f"checkpointing) / (GPUs x {self.peak_flops / 1e12:g} TFLOP/s peak x MFU {self.mfu:g}); "
                "+ 1F1B bubble (pp-1)/micro-batches x compute",
                f"  communication, not overlapped: tp all-reduces at {self.intra_node_bw / 1e9:g} GB/s intra-node "
                f"(tp <= {self.per_node} GPUs per node); pp sends and dp (ZeRO) collectives at "
                f"{self.inter_node_bw / 1e9:g} GB/s per GPU inter-node once they span nodes (ring collectives)"]


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    ep_comm: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm + self.ep_comm


def step_time(cfg: ModelConfig, layout: Layout, psi: int, cm: CostModel) -> StepTime:
    """Seconds per optimizer step of `layout` (psi: parameters per device before ZeRO)."""
    state, elem = PRECISION_BYTES[layout.precision]
    s, b, h, m = layout.seq_len, layout.micro_batch, cfg.d_model, layout.grad_accum
    tokens = layout.global_batch * s
    recompute = 4 / 3 if layout.checkpointing else 1.0
    compute = model_flops_per_token(cfg, s) * tokens * recompute / (layout.gpus * cm.peak_flops * cm.mfu)
    bubble = compute * (layout.pp - 1) / (m * layout.virtual)
    act = s * b * h * elem
    tp_comm = 0.0
    if layout.tp > 1:
        layers = -(-cfg.n_layer // layout.pp)
        calls = layers * m * (6 if layout.checkpointing else 4)
        bw = cm.intra_node_bw if layout.tp <= cm.per_node else cm.inter_node_bw
        tp_comm = calls * 2 * (layout.tp - 1) / layout.tp * act / bw
    pp_comm = 0.0
    if layout.pp > 1:
        bw = cm.inter_node_bw if layout.tp * layout.pp > cm.per_node else cm.intra_node_bw
        pp_comm = 2 * m * act / bw  # each stage sends every micro-batch's activation and gradient once
    dp_bw = cm.inter_node_bw if layout.gpus > cm.per_node else cm.intra_node_bw
    if layout.sharding == "flat":
        dp_comm = communication_volume(psi, layout.dp, layout.zero, state, grad_accum=m).bytes / dp_bw
    else:
        dp_comm = link_volume(psi, layout.dp, layout.dp_per_node, layout.zero, layout.sharding,
                              grad_accum=m).seconds(state.params, cm.intra_node_bw, cm.inter_node_bw)
    ep_comm = 0.0
    if layout.ep > 1 and cfg.n_experts:
        moe_layers = -(-sum(cfg.moe_layer(i) for i in range(cfg.n_layer)) // layout.pp)  # the fullest stage's
        bw = cm.intra_node_bw if layout.tp * layout.ep <= cm.per_node else cm.inter_node_bw
        from megazoo.parallel.expert.comms import all_to_all_bytes  # imports torch: only for an MoE layout

        per_layer = all_to_all_bytes(s * b, cfg.moe_top_k, h, layout.ep, elem, 6 if layout.checkpointing else 4)
        ep_comm = moe_layers * m * per_layer / bw
    return StepTime(compute, bubble, tp_comm, pp_comm, dp_comm, ep_comm)


@dataclass(frozen=True)
class Candidate:
    memory: DeviceMemory
    time: StepTime

    @property
    def layout(self) -> Layout:
        return self.memory.layout


def search(cfg: ModelConfig, gpus: int, capacity_gb: float, cm: CostModel, *, global_batch: int, seq_len: int,
           precision: str = "fp16", flash_attention: bool = True, max_pp: int | None = None,
           zero_stages=(0, 1, 2, 3), paper: bool = False) -> list[Candidate]:
    """Every (dp, tp, pp, zero, ep, checkpointing) on `gpus` GPUs with the largest micro-batch that fits (a divisor
    of global_batch / dp), ranked by estimated step time (fastest first). `paper`: model states by the ZeRO
    paper's formulas instead of megazoo's optimizers' bytes (recipes/planner/fit.py state_memory)."""
    if gpus < 1 or global_batch < 1:
        raise PlanError(f"--gpus {gpus} / global batch {global_batch} must be >= 1")
    found = []
    tps = [t for t in divisors(cfg.n_head) if cfg.d_ff % t == 0 and t <= cm.per_node and gpus % t == 0]
    for tp in tps:
        for pp in divisors(gpus // tp):
            if pp > min(cfg.n_layer, max_pp or cfg.n_layer):
                continue
            dp = gpus // (tp * pp)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            eps = [e for e in divisors(dp) if cfg.n_experts % e == 0] if cfg.n_experts else [1]
            for (zero, sharding), ep in ((z, e) for z in _zero_choices(zero_stages, dp, tp, cm.per_node) for e in eps):
                if (zero == 3 and pp > 1) or (zero and dp == 1):  # megazoo: no stage 3 with pp; dp 1: nothing to split
                    continue
                if ep > 1 and sharding != "flat":  # resolve refuses HSDP / hpZ with expert parallelism
                    continue
                for ckpt in (False, True):
                    base = Layout(dp, tp, pp, zero, 1, per_rank, seq_len, ckpt, precision=precision,
                                  flash_attention=flash_attention, sharding=sharding, node_size=cm.per_node, ep=ep)
                    try:
                        mb = _best_micro_batch(cfg, base, capacity_gb, per_rank, paper)
                    except PlanError:  # a layout the model refuses (an MoE's pooled aux loss at pp > 1)
                        continue
                    if not mb:
                        continue
                    lay = replace(base, micro_batch=mb, grad_accum=per_rank // mb)
                    mem = device_memory(cfg, lay, capacity_gb, paper=paper)
                    found.append(Candidate(mem, step_time(cfg, lay, mem.psi, cm)))
    return sorted(found, key=lambda c: c.time.total)


def _zero_choices(stages, dp: int, tp: int, per_node: int) -> list[tuple[int, str]]:
    """(stage, sharding) pairs: flat always; HSDP (stages 1-3) and hpZ (stage 3) when the dp group spans nodes
    and splits evenly into them (parallel/topology.check_node_size's rule)."""
    node_dp = per_node // tp if per_node % tp == 0 else 0
    spans = 0 < node_dp < dp and dp % node_dp == 0
    out = []
    for zero in stages:
        out.append((zero, "flat"))
        if spans and zero:
            out.append((zero, "hsdp"))
        if spans and zero == 3:
            out.append((zero, "hpz"))
    return out


def _best_micro_batch(cfg: ModelConfig, base: Layout, capacity_gb: float, per_rank: int, paper: bool) -> int:
    # The in-flight count depends on grad_accum (pipeline): size it for the largest micro-batch first.
    mb = max_micro_batch(cfg, base, capacity_gb, limit=per_rank, divides=per_rank, paper=paper)
    while mb and not device_memory(cfg, replace(base, micro_batch=mb, grad_accum=per_rank // mb), capacity_gb,
                                   paper=paper).fits:
        mb = max(d for d in divisors(per_rank) if d < mb) if mb > 1 else 0
    return mb
