"""What `megazoo verify` runs: the user's recipe shrunk to this machine, and the one-process reference.

The layout keeps every feature of the recipe that decides how the function is computed (ZeRO stage and offload,
tp, pp with its schedule and virtual stages, cp with its attention, the compressed optimizer, activation
checkpointing, fp16 loss scaling, the architecture's options) at degree <= 2 each; the model keeps its preset's
options but shrinks to a few layers and small widths (4 heads of 8, so heads divide by tp and, for all-to-all
context parallelism, local heads by cp). Both runs are fp64, dropout off, on synthetic tokens: then two layouts
that compute the same function agree to ~1e-15 and a layout bug stands out by ten orders of magnitude.

The reference is one process (dp = tp = pp = cp = 1, ZeRO 0, AdamW, no recomputation, no loss scaling) with the
same global batch (micro_batch x dp in one micro-batch per accumulation step), so the same samples per step.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from megazoo.recipes.config import Recipe, RecipeError
from megazoo.recipes.resolve import Resolved, model_config, resolve
from megazoo.recipes.sft_section import SFTSection
from megazoo.recipes.verify.precision import TOLERANCES, Tolerances, own_precision

MAX_DEGREE = 2
SHRUNK_HEADS, HEAD_DIM = 4, 8  # 4 heads: divisible by tp (<= 2) x cp (<= 2) for all-to-all attention
SHRUNK_VOCAB, SHRUNK_SEQ = 300, 32  # 300: not a multiple of 128, so the padded-vocabulary path runs too
MICRO_BATCH = 2
BUCKET_ELEMENTS = 10_000  # a few ZeRO buckets on the shrunk model (~40k parameters)
LR, MIN_LR = 1e-3, 1e-4  # large enough that a few steps move every parameter visibly
# --device cuda: a truncated model at realistic widths (max(2, pp x v) blocks), where low-precision rounding
# behaves as in the real run: d_model up to 1024 in heads of 64, the recipe's vocabulary, 128 positions.
GPU_MAX_D_MODEL, GPU_HEAD_DIM, GPU_SEQ = 1024, 64, 128


@dataclass(frozen=True)
class VerifyPlan:
    layout: Resolved  # the recipe's features at degree <= 2 on the shrunk model, fp64
    reference: Resolved  # one process, same model and global batch
    exercised: list[str]  # the recipe's features the layout runs
    shrunk: list[str]  # "parallel.dp: 64 -> 2", ...
    changed: list[str]  # what verify sets for every recipe, and why
    not_compared: list[str]  # features of the recipe that cannot be held to one process here, and why
    loss_scaling: bool  # fp16 recipe: the layout runs its dynamic loss scaling (exact in fp64: powers of two)
    precision: str = "fp64"  # what both runs compute in
    device: str = "cpu"  # "cuda": one GPU per rank, NCCL
    tolerances: Tolerances = TOLERANCES["fp64"]
    scratch: str = ""  # a folder verify wrote (synthetic SFT rows) and its caller removes: `discard`

    def discard(self) -> None:
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    @property
    def reference_text(self) -> str:
        ref = self.reference.recipe.parallel
        return "one process" if ref.dp == 1 else f"data parallelism dp={ref.dp} ({ref.dp} processes, ZeRO 0)"


def _for_checking(recipe: Recipe) -> tuple[Recipe, list[str]]:
    """The recipe with what verify never reads swapped out (its data, checkpoints to load or resume, the closing
    sample), so the rest can be checked at full size before any process starts."""
    notes = []
    data = replace(recipe.data, source="synthetic", paths=(), valid_paths=(), weights=(), tokenizer="")
    if recipe.data.source != "synthetic":
        notes.append(f"data: synthetic tokens instead of data.source = {recipe.data.source!r} (the data is not "
                     "part of the layout)")
    sft = recipe.sft
    if sft.path:  # plan() writes synthetic fine-tuning rows in the shrunk sizes instead (a lone valid_path is refused)
        sft = SFTSection(packing=sft.packing)
        notes.append(f"sft: synthetic fine-tuning rows (random examples, uneven response shares) instead of sft.path "
                     f"= {recipe.sft.path!r} (train and validation splits; packing {recipe.sft.packing} as the recipe)")
    model, ckpt = recipe.model, recipe.checkpoint
    if model.from_checkpoint and not (ckpt.load and Path(ckpt.load).exists()):
        model = replace(model, from_checkpoint=False)
        notes.append(f"model: preset {model.preset!r} (checkpoint.load = {ckpt.load!r} is not there to give the "
                     "architecture)")
    if model.from_hf and not Path(model.from_hf).exists():
        model = replace(model, from_hf="")
        notes.append(f"model: preset {model.preset!r} (model.from_hf = {recipe.model.from_hf!r} is not there to "
                     "give the architecture)")
    keep_load = model.from_checkpoint  # its architecture is read from it; its weights are never loaded
    ckpt = replace(ckpt, load=ckpt.load if keep_load else "", resume=False, every=0, at_end=False)
    return replace(recipe, data=data, model=model, checkpoint=ckpt, sft=sft,
                   sample=replace(recipe.sample, tokens=0)), notes


def _shrunk_degrees(recipe: Recipe) -> dict[str, int]:
    par = recipe.parallel
    return {name: min(getattr(par, name), MAX_DEGREE) for name in ("dp", "tp", "pp", "cp")}


def _shrunk_node_size(node_size: int, deg: dict[str, int]) -> int:
    """A recipe that states its node size runs as two "nodes" when the shrunk world allows (so HSDP and hpZ still
    cross a node boundary), else one; 0 (the launcher's local world size) stays 0."""
    world = deg["dp"] * deg["tp"] * deg["pp"] * deg["cp"]
    return 0 if not node_size else world // 2 if world >= 4 and world % 2 == 0 else world


def _shrunk_ep(ep: int, deg: dict[str, int], n_experts: int) -> int:
    """The largest expert-parallel degree up to the recipe's that divides the shrunk dp x cp and the experts."""
    return max(e for e in range(1, ep + 1) if (deg["dp"] * deg["cp"]) % e == 0 and (n_experts or 1) % e == 0)


def _grad_accum(recipe: Recipe, pp: int) -> int:
    """Micro-batches per step: up to 2 per pipeline stage (so 1F1B reaches its steady state); a multiple of pp
    for the interleaved schedule."""
    ga = min(recipe.train.grad_accum, 2 * pp)
    if recipe.parallel.schedule == "interleaved":
        ga = max(pp, ga - ga % pp)
    return ga


def moe_experts(cfg, n_layer: int, d_model: int) -> dict:
    """The MoE fields of the shrunk model: 4 experts (top-2 at most), widths at the preset's ratios."""
    width = lambda f: max(2, 2 * round(d_model * f / cfg.d_model / 2))  # noqa: E731 (even: tp <= 2)
    fields = dict(n_experts=min(cfg.n_experts, 4), moe_top_k=min(cfg.moe_top_k, 2), moe_d_ff=width(cfg.moe_d_ff),
                  moe_shared_d_ff=width(cfg.moe_shared_d_ff), moe_every=min(cfg.moe_every, n_layer),
                  moe_first_dense=min(cfg.moe_first_dense, n_layer - 1),
                  moe_dense_layers=tuple(i for i in cfg.moe_dense_layers if i < n_layer))
    if cfg.moe_n_group > 1:  # group-limited routing (DeepSeek-V3: 4 of 8 groups) kept: 2 groups of 2, a token's from 1
        fields.update(moe_n_group=2, moe_topk_group=1 if cfg.moe_topk_group < cfg.moe_n_group else 2)
    if not any(cfg.replace(n_layer=n_layer, **fields).moe_layer(i) for i in range(n_layer)):
        fields.update(moe_first_dense=0, moe_dense_layers=())
    return fields


def plan(recipe: Recipe, steps: int, precision: str = "fp64", device: str = "cpu") -> VerifyPlan:
    """The layout and reference runs for `recipe`; raises RecipeError (before any process) when the recipe is
    invalid at its own size or `steps` is not positive. `precision` "own": both runs in the recipe's precision
    and the reference is data-parallel (recipes/verify/precision.py); `device` "cuda": a truncated model at
    realistic widths, one GPU per rank (own precision)."""
    if steps < 1:
        raise RecipeError(f"--steps {steps} is invalid: it must be a positive number of steps")
    if precision not in ("fp64", "own") or device not in ("cpu", "cuda"):
        raise RecipeError(f"precision {precision!r} / device {device!r} is invalid: valid are fp64 or own / cpu or "
                          "cuda")
    own = precision == "own" or device == "cuda"
    run_precision = own_precision(recipe.train.precision, device) if own else "fp64"
    checkable, changed = _for_checking(recipe)
    full = resolve(checkable)  # the recipe's own checks at its real size (arithmetic only)
    cfg, par, train = full.model, recipe.parallel, recipe.train
    deg = _shrunk_degrees(recipe)
    virtual = min(par.virtual_stages, MAX_DEGREE)
    n_layer = max(2, deg["pp"] * virtual)
    heads, head_dim, vocab, seq = SHRUNK_HEADS, HEAD_DIM, min(cfg.vocab_size, SHRUNK_VOCAB), SHRUNK_SEQ
    if device == "cuda":  # heads of 64 up to d_model 1024, a multiple of 4 heads (tp x cp <= 4)
        heads = max(SHRUNK_HEADS, 4 * (min(cfg.d_model, GPU_MAX_D_MODEL) // GPU_HEAD_DIM // 4))
        head_dim, vocab, seq = GPU_HEAD_DIM, cfg.vocab_size, GPU_SEQ
    d_model = heads * head_dim
    ratio = cfg.d_ff / cfg.d_model
    d_ff = max(2, 2 * round(d_model * ratio / 2))  # the preset's MLP ratio, even (divisible by tp <= 2)
    ga = _grad_accum(recipe, deg["pp"])
    model_over = {"n_layer": n_layer, "n_head": heads, "d_model": d_model, "d_ff": d_ff,
                  "vocab_size": vocab, "n_positions": seq, "dropout": 0.0, "attn_dropout": 0.0}
    if cfg.n_kv_head < cfg.n_head:  # grouped-query attention stays grouped: 2 heads per kv head (1 for MQA),
        model_over["n_kv_head"] = 1 if cfg.n_kv_head == 1 else heads // 2  # split over tp <= 2 as in the recipe
    if cfg.attention == "sparse":
        model_over["sparse_block"] = 4  # 8 blocks of 4 in the shrunk sequence
    model_over["head_width"] = 0  # Qwen3's heads wider than d_model / n_head shrink to d_model / n_head too
    if cfg.n_experts:  # a few small experts, routed as the recipe's; its dense-layer pattern where it still fits
        model_over.update(moe_experts(cfg, n_layer, d_model))
    model = replace(checkable.model, from_checkpoint=False, from_hf="", **model_over)
    if checkable.model.from_checkpoint or checkable.model.from_hf:  # its architecture options, shrunk sizes
        model = replace(model, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                                  if f.name not in model_over and f.name != "name" and hasattr(model, f.name)})
    scratch, sft = "", checkable.sft
    if recipe.sft.path:  # recipes/verify/synthetic_sft.py: both runs read the same synthetic rows
        from megazoo.recipes.verify.synthetic_sft import write_synthetic_sft
        scratch = tempfile.mkdtemp(prefix="megazoo-verify-")
        path, valid = write_synthetic_sft(Path(scratch), min(vocab, cfg.vocab_size), seq)
        sft = replace(recipe.sft, path=path, valid_path=valid)
    layout = replace(
        checkable,
        model=model,
        sft=sft,
        # the checkpoint gave the architecture's options (above); the shrunk model cannot load its weights, and
        # both runs start from the same initial weights without them
        checkpoint=replace(checkable.checkpoint, load=""),
        parallel=replace(par, **deg, virtual_stages=virtual, layers=(), timeout_s=min(par.timeout_s, 300.0),
                         node_size=_shrunk_node_size(par.node_size, deg),
                         ep=_shrunk_ep(par.ep, deg, model.n_experts or 0)),
        train=replace(train, steps=steps, micro_batch=MICRO_BATCH, grad_accum=ga, global_batch=None,
                      seq_len=seq, lr=LR, min_lr=MIN_LR, warmup_steps=1, lr_decay_steps=None,
                      precision=run_precision, eval_every=0, eval_batches=1),
        zero=replace(recipe.zero, reduce_bucket_size=min(recipe.zero.reduce_bucket_size, BUCKET_ELEMENTS)),
        optimizer=replace(recipe.optimizer, freeze_step=max(recipe.optimizer.freeze_step, steps)),
        kernels=replace(recipe.kernels, adamw="reference"),
        data=replace(checkable.data, synthetic_tokens=20_000),
        logging=replace(recipe.logging, wandb="off", progress=False),
    )
    # fp64: one process holding the global micro-batch; own precision: the layout's dp ranks, plain data
    # parallelism (the same micro-batches, so the same rounding of each sample's forward and backward)
    ref_dp, ref_micro = (deg["dp"], MICRO_BATCH) if own else (1, MICRO_BATCH * deg["dp"])
    reference = replace(
        layout,
        parallel=replace(layout.parallel, dp=ref_dp, tp=1, pp=1, cp=1, schedule="1f1b", virtual_stages=1,
                         partition="uniform", sequence_parallel=False, node_size=0, ep=1),
        train=replace(layout.train, micro_batch=ref_micro, activation_checkpointing=False),
        zero=replace(layout.zero, stage=0, offload="none"),
        optimizer=replace(layout.optimizer, name="adamw"),
    )
    try:
        layout_res, reference_res = resolve(layout), resolve(reference)
    except RecipeError as err:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        raise RecipeError(f"the shrunk recipe is invalid (a gap in megazoo verify, not in your recipe): {err}") \
            from None
    shrunk = [f"parallel.{k}: {getattr(par, k)} -> {v}" for k, v in deg.items() if getattr(par, k) != v]
    if layout.parallel.ep != par.ep:
        shrunk.append(f"parallel.ep: {par.ep} -> {layout.parallel.ep}")
    if virtual != par.virtual_stages:
        shrunk.append(f"parallel.virtual_stages: {par.virtual_stages} -> {virtual}")
    if par.layers:
        shrunk.append("parallel.layers: dropped (the shrunk model has other blocks); partition "
                      f"{par.partition!r} instead")
    small = layout_res.model
    before = {name: getattr(cfg, name) for name in ("n_layer", "n_head", "d_model", "d_ff", "vocab_size",
                                                    "n_positions")}
    if recipe.data.source == "stdlib" and recipe.model.vocab_size is None:
        before["vocab_size"] = recipe.data.vocab_size  # the recipe's own BPE sets it (the data is swapped above)
    for name, old in before.items():
        if old != getattr(small, name):
            shrunk.append(f"model.{name}: {old} -> {getattr(small, name)}")
    for name, new in (("seq_len", seq), ("micro_batch", MICRO_BATCH), ("grad_accum", ga)):
        if getattr(train, name) != new:
            shrunk.append(f"train.{name}: {getattr(train, name)} -> {new}")
    changed += [
        f"train.precision: {train.precision!r} -> 'fp64' (layouts agree to ~1e-15; a bug shows by orders of "
        "magnitude)" if not own else f"train.precision: {run_precision!r} (the recipe's own on {device}), "
        "tolerances for it (recipes/verify/precision.py)",
        f"train.lr {LR:g} (min {MIN_LR:g}), 1 warmup step, cosine over the {steps} steps: every parameter moves",
        "model.dropout = attn_dropout = 0 (dropout masks depend on where a sample is computed)",
        "kernels.adamw = 'reference' (the fused CPU AdamW rounds by SIMD lane, i.e. by ZeRO buffer offset)",
    ]
    exercised, not_compared = _features(recipe, layout_res, steps)
    if own:  # its rounding is what is compared now
        not_compared = [line for line in not_compared if not line.startswith("train.precision")]
    return VerifyPlan(layout_res, reference_res, exercised, shrunk, changed, not_compared,
                      loss_scaling=train.precision == "fp16" and not own, precision=run_precision, device=device,
                      tolerances=TOLERANCES.get(run_precision, TOLERANCES["fp32"]).for_steps(steps, run_precision),
                      scratch=scratch)


def _features(recipe: Recipe, layout: Resolved, steps: int) -> tuple[list[str], list[str]]:
    par, small, zero = layout.recipe.parallel, layout.recipe, layout.recipe.zero
    out = [f"data parallel dp={par.dp}" if par.dp > 1 else None,
           f"tensor parallel tp={par.tp}" if par.tp > 1 else None,
           (f"pipeline pp={par.pp}, schedule {par.schedule!r}"
            + (f", {par.virtual_stages} virtual stages" if par.virtual_stages > 1 else "")
            + f", {small.train.grad_accum} micro-batches, partition {par.partition!r}") if par.pp > 1 else None,
           f"context parallel cp={par.cp} ({par.cp_attention})" if par.cp > 1 else None,
           f"expert parallel ep={par.ep} (all-to-all token dispatch)" if par.ep > 1 else None,
           f"ZeRO stage {zero.stage}" + (f", offload {zero.offload!r}" if zero.offload != "none" else "")
           + f", buckets of {zero.reduce_bucket_size} elements" if zero.stage or par.dp > 1 else None,
           "gradient accumulation" if small.train.grad_accum > 1 else None,
           "activation checkpointing" if small.train.activation_checkpointing else None,
           f"fp16 dynamic loss scaling (initial scale {recipe.loss_scale.initial_scale:g}, in fp64)"
           if recipe.train.precision == "fp16" else None,
           f"sparse attention ({layout.model.sparse_pattern})" if layout.model.attention == "sparse" else None,
           f"{small.optimizer.name} (its warm-up: {steps} full-precision steps)"
           if small.optimizer.name != "adamw" else None,
           f"gradient clipping at {small.train.grad_clip:g}" if small.train.grad_clip > 0 else None,
           f"fine-tuning rows ({'packed' if small.sft.packing else 'one per padded row'}, response-only loss, "
           "micro-batches weighted by response tokens)" if small.sft.path else None,
           f"LoRA rank {small.lora.rank} (the base frozen)" if small.lora.rank else None]
    not_compared = []
    precision = recipe.train.precision
    if precision != "fp64":
        what = {"auto": "fp32 on CPU, bf16 autocast on GPU", "fp32": "fp32", "bf16": "bf16 autocast and storage",
                "fp16": "fp16 autocast and storage"}[precision]
        not_compared.append(f"train.precision = {precision!r} ({what}): its rounding is not a layout property and "
                            "is not reproduced here (fp64 instead)")
    if recipe.optimizer.name != "adamw":
        not_compared.append(f"optimizer.name = {recipe.optimizer.name!r}: the compressed steps (after "
                            "optimizer.freeze_step) are lossy by design, so only its warm-up is held to one process")
    return [f for f in out if f], not_compared
