"""What the training loop trains: this rank's model chunks, in which dtype, under which ZeRO stage.

Initial weights come from the recipe's seed and depend only on (seed, parameter name, global shape), so every
(dp, tp, pp, ZeRO) layout starts from the same full model; under ZeRO-3 the chunks are built on the meta device
and the optimizer materialises them one unit at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from megazoo.kernels import Kernels, resolve_kernels
from megazoo.models.lora.adapters import attach_lora
from megazoo.models.moe import MoE
from megazoo.models.moe.dispatch import combine_sorted, expert_parameter_names
from megazoo.models.moe.router import materialize_router_buffers
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_parameter_, init_weights
from megazoo.parallel.expert.zero import JointLedger, build_expert_split
from megazoo.parallel.context import positions
from megazoo.parallel.fault_tolerance.diloco import DiLoCo
from megazoo.parallel.pipeline.fb_overlap import Compute, Stage
from megazoo.parallel.pipeline.moe_stages import moe_sub_stages
from megazoo.parallel.pipeline.partition import rank_chunks
from megazoo.parallel.pipeline.schedules import placement
from megazoo.parallel.tensor import named_shards
from megazoo.parallel.tensor.fp8 import check_fp8_device, enable_fp8
from megazoo.parallel.tensor.random import TPRNGTracker
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.build import build_zero
from megazoo.parallel.zero.interface import ZeroOptimizer
from megazoo.parallel.zero.loss_scaler import DynamicLossScaler
from megazoo.parallel.zero.partitioned import TiedParameters
from megazoo.recipes.resolve import Resolved, compression_of


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: "auto" is bf16 on CUDA and fp32 on CPU."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[precision]


def configure_matmuls(device: torch.device, tf32: bool) -> None:
    """TF32 for fp32 matmuls on GPU (the recipe's train.tf32): ~8x the fp32 throughput at a 10-bit mantissa,
    which training tolerates. Process-wide torch flags, so only the GPU path sets them; the CPU is untouched."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def parameter_dtype(compute: torch.dtype, zero_stage: int) -> torch.dtype:
    """Under ZeRO >= 1 the fp32 masters live in the partitioned optimizer: parameters are stored in the compute
    dtype. Stage 0 keeps fp32 parameters and runs half precision as autocast (torch AMP style)."""
    half = compute in (torch.float16, torch.bfloat16)
    return compute if (half and zero_stage >= 1) or compute == torch.float64 else torch.float32


@dataclass(frozen=True)
class Precision:
    """The recipe's train.precision on this device: what matmuls run in, what parameters are stored in."""

    compute: torch.dtype
    params: torch.dtype
    device_type: str

    @classmethod
    def of(cls, res: Resolved, device: torch.device) -> "Precision":
        compute = compute_dtype(res.recipe.train.precision, device)
        return cls(compute, parameter_dtype(compute, res.recipe.zero.stage), device.type)

    def autocast(self):
        """bf16/fp16 forwards under torch.autocast; fp32/fp64 as they are. Without autocast's weight cache:
        it keeps the 16-bit cast of every fp32 parameter a forward used until the forward returns, 2 bytes per
        parameter at the forward's end (megatron-8.3b at ZeRO-0: 2.1 GB, the step's peak), though each weight is
        cast once per forward anyway; a matmul still keeps its own cast for backward, a recomputed block none."""
        if self.compute in (torch.float16, torch.bfloat16):
            return torch.autocast(self.device_type, dtype=self.compute, cache_enabled=False)
        return contextlib.nullcontext()

    def loss_scaler(self, res: Resolved) -> DynamicLossScaler | None:
        """fp16 needs dynamic loss scaling; nothing else does."""
        ls = res.recipe.loss_scale
        return DynamicLossScaler(ls.initial_scale, ls.growth_interval, ls.hysteresis, ls.min_scale) \
            if self.compute == torch.float16 else None


def run_kernels(res: Resolved, device: torch.device, precision: Precision) -> Kernels:
    """Which implementation runs each fused op, for the model's compute dtype on `device`; AdamW where the
    optimizer states live (the CPU under ZeRO-Offload), on fp32 masters (fp64 in fp64 runs)."""
    return resolve_kernels(res.recipe.kernels.choice(), device, precision.compute,
                           optimizer_device="cpu" if res.recipe.zero.offload == "cpu" else device,
                           optimizer_dtype=torch.promote_types(precision.params, torch.float32))


def build_model(res: Resolved, topo: Topology, device=None, dtype: torch.dtype = torch.float32,
                kernels=None) -> list[GPT]:
    """This rank's model chunks: its tp shard of each pipeline (virtual) stage it holds; one chunk, the whole
    model, when pp = 1. Initialised from the recipe's seed: identical full weights for every layout. With
    device="meta" nothing is allocated (ZeRO-3 materialises it unit by unit).

    zbv's V puts the first and the last stage on pipeline rank 0: its two chunks then share one embedding module
    (the tied weight is one parameter there, its gradient accumulated by both chunks' backward)."""
    train, par, cfg = res.recipe.train, res.recipe.parallel, res.model
    rng = TPRNGTracker(train.seed, topo.tp_rank, topo.device)
    stages = res.stage_layers
    chunks = []
    for stage in rank_chunks(stages, topo.pp, topo.pp_rank, placement(par.schedule) if topo.pp > 1 else "loop"):
        chunk = GPT(cfg, topo, layers=range(stages[stage][0], stages[stage][-1] + 1),
                    with_embedding=stage == 0, with_head=stage == len(stages) - 1, rng=rng,
                    activation_checkpointing=train.activation_checkpointing, device=device or topo.device,
                    dtype=dtype, kernels=kernels, fused_loss=res.fused_loss)
        if res.recipe.lora.enabled:  # adapters on the recipe's targets; every other parameter frozen
            attach_lora(chunk, res.recipe.lora)
        if train.fp8 != "none":  # the blocks' attention and MLP projections (parallel/tensor/fp8.py)
            check_fp8_device(topo.device)
            enable_fp8(chunk, train.fp8)
        if device != "meta":
            init_weights(chunk, train.seed)
        else:  # ZeRO-3 makes the parameters real unit by unit; the routing bias buffers are made here
            materialize_router_buffers(chunk.modules(), topo.device)
        if chunks and hasattr(chunk, "wte") and hasattr(chunks[0], "wte"):
            chunk.wte = chunks[0].wte  # the V's last stage beside the first: one tied weight
        chunks.append(chunk)
    assert len(chunks) == par.virtual_stages
    if train.compile != "none":
        compile_blocks(chunks, train.compile)
    return chunks


def compile_blocks(chunks: list[GPT], mode: str) -> None:
    """train.compile = "blocks": each transformer block's forward (and, through AOTAutograd, its backward) runs
    torch.compile'd, in place (nn.Module.compile: parameter names, state dicts and hooks stay the module's own).
    Blocks, not the whole stage: they are where the FLOPs and the elementwise chains are, they are alike (one
    compiled graph reused by every block: the guards are on shapes and dtypes, parameters are graph inputs), and
    what lies between them (embedding, head, loss, ZeRO's bucket hooks, pipeline sends) keeps its eager
    collectives. The fused kernels are torch ops with fake implementations (kernels/triton_common.py), so the
    model's Triton kernels are traced as one node each. "blocks:aot_eager": the same capture without code
    generation (AOTAutograd runs the captured graphs eagerly): for tests and for telling a tracing problem from
    an Inductor one. benchmarks/compile.py measures what it buys on this machine."""
    backend = "aot_eager" if mode == "blocks:aot_eager" else "inductor"
    for chunk in chunks:
        for block in chunk.h.values():
            block.compile(backend=backend, dynamic=False)


def build_optimizer(res: Resolved, topo: Topology, chunks: list[GPT], kernels: Kernels) -> ZeroOptimizer:
    """The recipe's ZeRO stage over every chunk's parameters. With pp > 1 the embedding lives on the first and
    the last stage when the head is tied: its gradients are summed over the embedding group and counted once in
    the norm (an untied lm_head lives on the last stage only)."""
    t, zero, model = res.recipe.train, res.recipe.zero, chunks[0]
    named, seen = [], set()
    for chunk in chunks:  # a parameter shared by two chunks (zbv's tied embedding on rank 0) is listed once
        for entry in named_shards(chunk):
            if entry[1] not in seen:
                seen.add(entry[1])
                named.append(entry)
    chunk_of = {}
    for i, chunk in enumerate(chunks):
        for name, _ in chunk.named_parameters():
            chunk_of.setdefault(name, i)
    # The tied embedding's two copies live on the first and the last pipeline rank (summed over the embedding
    # group); under zbv's V both ends are on rank 0 and share one parameter: nothing to sum, but it still gets a
    # bucket of its own: its gradient hook fires in both chunks' W, and a bucket shared with one chunk's other
    # parameters would be completed (ZeRO-2: copied, then overwritten) by one W without the other's part.
    # an untied lm_head shares nothing with the embedding; multi-token prediction's lookup on the last stage does
    if topo.pp == 1 or not (res.model.tie_embeddings or res.model.mtp_depth):
        tied = TiedParameters()
    elif placement(res.recipe.parallel.schedule) == "v":
        tied = TiedParameters(frozenset({"wte.weight"}), None, counted_in_norm=True)
    else:
        tied = TiedParameters(frozenset({"wte.weight"}), topo.embedding_group, counted_in_norm=topo.is_first_stage)
    build, split = build_zero, {}
    if topo.ep > 1:  # expert weights over their expert-data-parallel group, dense ones over dp x cp
        experts = {name for chunk in chunks for name in expert_parameter_names(chunk)}
        build, split = build_expert_split, {"build": build_zero, "is_expert": experts.__contains__}
    for chunk in chunks:  # ZeRO-3 materialises parameters only: the buffers (DeepSeek's routing bias and its
        for module in chunk.modules():  # load counts, both zeros at the start) are made here, on every rank
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf.is_meta:
                    module.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype, device=topo.device),
                                           persistent=name not in module._non_persistent_buffers_set)
    zero = build(
        stage=zero.stage, model=model, named=named, topo=topo, **split, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
        weight_decay=t.weight_decay, bucket_elements=zero.reduce_bucket_size, offload=zero.offload,
        units=list(model.h.values()), tied=tied, group_of=chunk_of.get, adamw=kernels["adamw"].fn,
        compression=compression_of(res.recipe),  # [optimizer]: 1-bit / 0-1 Adam (parallel/compressed/)
        shard_group=zero.shard_group, hpz=zero.hpz,  # HSDP / ZeRO++ hpZ (parallel/zero/groups.py)
        quantized_weights=zero.quantized_weights,  # ZeRO++ qwZ (parallel/zero/quantized.py)
        quantized_gradients=zero.quantized_gradients,  # ZeRO++ qgZ (parallel/zero/qgz.py)
        replica_reduce=not res.recipe.diloco.enabled,  # DiLoCo: gradients stay in the node, its outer step crosses
        **({"fp8_all_gather": True} if zero.fp8_all_gather else {}),  # float8 weight gathers (zero/gather/fp8.py)
        init_fn=lambda module, name, tensor, spec: init_parameter_(model, module, name, tensor, spec, t.seed))
    if topo.ep > 1 and isinstance(zero.comm, JointLedger):  # the step's traffic includes the MoE all-to-alls
        zero.comm.ledgers += [m.dispatcher.comm for chunk in chunks for m in chunk.modules()
                              if hasattr(getattr(m, "dispatcher", None), "comm")]
    if res.recipe.diloco.enabled:  # the outer step across nodes every diloco.inner_steps steps
        zero = DiLoCo(zero, topo, res.recipe.diloco)
    return zero


def overlap_sub_stages(gpt: GPT) -> list[Stage]:
    """One decoder chunk (models/transformer.GPT) as the forward/backward overlap's sub-stages
    (parallel/pipeline/fb_overlap.py): the embedding, each dense block and the final norm + head as single
    computes; each MoE block as moe_sub_stages' route | dispatch | experts | combine | after, its attention half
    and the router in the route compute, with what MoE.forward does beside the dispatch: the RouterStats and
    their all-reduces, the routing-bias load and the "layer"-scope losses (carried by the routing weights, whose
    gradient always comes back through the combine); the shared experts and the residual in the after compute.
    Each compute is its own autograd graph, so nothing of one may reach another but through the running tuple:
    the residual stream rides beside the routed rows, and the stats the model keeps for its "model"-scope loss
    and the metrics are detached (that loss must then have zero coefficients: refused otherwise)."""
    cfg, topo = gpt.cfg, gpt.topo
    refused = [(f, v, valid) for f, v, valid in (
        ("train.activation_checkpointing", gpt.activation_checkpointing, "false"),
        ("model.mtp_depth", cfg.mtp_depth, "0"),
        ("model.moe_capacity_factor", cfg.moe_capacity_factor, "0 (dropless)"),
        ("the fused loss (train.fused_loss)", gpt.fused_loss, "false"),
        ("model.dropout", cfg.dropout, "0"),
        ("model.attn_dropout", cfg.attn_dropout, "0"),
        ("parallel.cp", topo.cp if topo.cp > 1 else 0, "1"),
        ("parallel.sequence_parallel", topo.sequence_parallel, "false")) if v]
    coefs = cfg.moe_aux_loss_coef or cfg.moe_z_loss_coef or cfg.moe_seq_aux_loss_coef
    if cfg.moe_aux_loss_scope == "model" and coefs:
        refused.append(("model.moe_aux_loss_scope", "'model' with non-zero coefficients", "'layer'"))
    if refused:
        field, value, valid = refused[0]
        raise ValueError(f"parallel.fb_overlap: {field} = {value!r} is not built into the sub-staged decoder "
                         f"chunk (recipes/training/model_setup.overlap_sub_stages); valid: {valid}")
    stages: list[Stage] = []
    if gpt.with_embedding:
        def embed(ctx: dict, inputs: tuple) -> tuple:
            x = gpt.wte(inputs[0])
            if cfg.positions == "learned":
                x = x + gpt.wpe(positions(inputs[0].shape[1], 1, 0, x.device))
            return (gpt.drop(x),)
        stages.append(Compute("embed", embed))
    for key, block in gpt.h.items():
        if isinstance(block.mlp, MoE):
            stages += _moe_block(f"h.{key}", block)
        else:
            stages.append(Compute(f"h.{key}", lambda ctx, inputs, block=block: (block(inputs[0]),)))
    if gpt.with_head:
        stages.append(Compute("head", lambda ctx, inputs: (gpt.logits(gpt.ln_f(inputs[0])),)))
    if gpt._forward_hooks:  # what follows the chunk's forward (MoEStepMetrics' sums) follows its last sub-stage
        def hooks(ctx: dict, inputs: tuple) -> tuple:
            for hook in list(gpt._forward_hooks.values()):
                hook(gpt, (), inputs[0])
            return inputs
        stages.append(Compute("forward_hooks", hooks))
    return stages


def _moe_block(name: str, block) -> list[Stage]:
    moe: MoE = block.mlp

    def before(ctx: dict, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        x = inputs[0]
        x = x + block._drop(block.attn(block.ln_1(x)))
        return block.ln_2(x), x  # (b, s, d): the rows to route, and the residual stream beside them

    def routed(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, weights, indices, scores = moe.route_rows(rows)
        counts = torch.bincount(indices.reshape(-1), minlength=moe.cfg.n_experts)  # the dispatcher's counts
        dropped = torch.zeros((), dtype=torch.int64, device=rows.device)
        # the batch size: read only by seq_aux, which needs the "model" scope with coefficients (refused)
        stats = moe.record(logits, scores, indices, counts, dropped, 0)
        moe.stats = dataclasses.replace(stats, prob_sum=stats.prob_sum.detach(), z_sum=stats.z_sum.detach(),
                                        seq_aux=None if stats.seq_aux is None else stats.seq_aux.detach())
        return moe.with_layer_losses(weights, stats), indices

    def after(ctx: dict, h: torch.Tensor, out: torch.Tensor, x: torch.Tensor) -> tuple:
        out = out.view(x.shape)
        if moe.cfg.moe_shared_experts:
            out = out + moe.shared_out(h)
        return (x + block._drop(out),)

    # the model dispatcher's own gather and combine (models/moe/dispatch.py), not the library's: the same ops
    # both ways, so bf16 / fp16 runs are bit-equal with and without the overlap
    def combine(rows: torch.Tensor, back: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine_sorted(rows, back, order // weights.shape[1], weights.reshape(-1)[order])

    return moe_sub_stages(name, before, routed, moe.experts, after, moe.cfg.n_experts,
                          getattr(moe.dispatcher, "group", None),  # None: ep = 1
                          gather=lambda rows, token: rows[token], combine=combine)
