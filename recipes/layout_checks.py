"""The resolver's checks of the parallel layout: pipeline stages and schedules, the optimizer and its compressed
communication, node sizes, and the checks whose code imports torch (run last, so every other mistake is reported
without loading torch). Each raises RecipeError naming the field, the value and what would be valid.
"""

from __future__ import annotations

import math

from megazoo.models.config import ModelConfig
from megazoo.models.layout import parameter_layout
from megazoo.parallel.compressed.schedule import OPTIMIZERS, CompressionSettings, check_settings
from megazoo.parallel.pipeline.partition import PARTITION_METHODS, virtual_stage_layers
from megazoo.parallel.pipeline.schedules import SCHEDULES
from megazoo.recipes.config import Recipe, RecipeError


def _choice(where: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise RecipeError(f"{where} = {value!r} is invalid; valid: {', '.join(repr(v) for v in valid)}")


def _positive(where: str, value, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise RecipeError(f"{where} = {value!r} is invalid: it must be a finite number "
                          f"{'>= 0' if allow_zero else '> 0'}")


def _check_pipeline(recipe: Recipe, cfg: ModelConfig) -> list[list[int]]:
    """Check the pipeline keys; return the blocks of each (virtual) stage."""
    par, train = recipe.parallel, recipe.train
    _choice("parallel.schedule", par.schedule, SCHEDULES)
    _choice("parallel.partition", par.partition, PARTITION_METHODS)
    _positive("parallel.virtual_stages", par.virtual_stages)
    if par.schedule == "interleaved":
        if par.virtual_stages < 2 or par.pp < 2:
            raise RecipeError(f"parallel.schedule = 'interleaved' needs parallel.virtual_stages >= 2 and pp >= 2 "
                              f"(got virtual_stages = {par.virtual_stages}, pp = {par.pp})")
        if train.grad_accum % par.pp:
            raise RecipeError(f"train.grad_accum = {train.grad_accum} (the pipeline's micro-batches) must be a "
                              f"multiple of parallel.pp = {par.pp} for the interleaved schedule; valid: "
                              f"{', '.join(str(par.pp * k) for k in range(1, 4))}, ...")
    elif par.schedule in ("zbv", "dualpipev"):
        if par.virtual_stages != 2:  # an unset virtual_stages is already 2 (recipes/config.py)
            raise RecipeError(f"parallel.virtual_stages = {par.virtual_stages} is invalid with parallel.schedule = "
                              f"{par.schedule!r}: it runs two chunks per rank, in a V; valid: 2, or leave "
                              "virtual_stages unset")
        if par.pp < 2:
            raise RecipeError(f"parallel.schedule = {par.schedule!r} needs parallel.pp >= 2 (got pp = {par.pp})")
        if par.schedule == "dualpipev" and train.grad_accum < 2 * par.pp - 1:
            raise RecipeError(f"train.grad_accum = {train.grad_accum} (the pipeline's micro-batches) must be at "
                              f"least 2 x parallel.pp - 1 = {2 * par.pp - 1} for the dualpipev schedule")
    elif par.virtual_stages != 1:
        raise RecipeError(f"parallel.virtual_stages = {par.virtual_stages} needs parallel.schedule = "
                          "'interleaved' (or 'zbv' / 'dualpipev' with 2); valid with gpipe/1f1b/zb_h1: 1")
    _check_fb_overlap(recipe, cfg)
    # "parameters" balancing counts the embeddings on the first stage and the head (the tied embedding's copy or
    # an untied lm_head) on the last, in units of one block's parameters (block 0's: every block has the same
    # shapes).
    numel = {p.name: p.numel for p in parameter_layout(cfg, vocab=cfg.vocab_size, layers=range(1))}
    per_block = sum(n for name, n in numel.items() if name.startswith("h.0."))
    embeddings = numel["wte.weight"] + numel.get("wpe.weight", 0)
    head = numel.get("lm_head.weight", numel["wte.weight"])
    try:
        stages = virtual_stage_layers(cfg.n_layer, par.pp, virtual=par.virtual_stages, method=par.partition,
                                      layers=par.layers or None, first_extra=embeddings / per_block,
                                      last_extra=head / per_block)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    if par.pp > 1 and recipe.zero.stage == 3:
        raise RecipeError("zero.stage = 3 with parallel.pp > 1 is not supported (each stage would gather and "
                          "free its blocks around every micro-batch); valid with pp > 1: zero.stage = 0, 1, 2")
    return stages


def compression_of(recipe: Recipe) -> CompressionSettings | None:
    """The recipe's [optimizer] as parallel/compressed's settings; None for plain AdamW."""
    o = recipe.optimizer
    if o.name == "adamw":
        return None
    return CompressionSettings(o.name, o.freeze_step, o.var_freeze_step, o.var_update_scaler, o.local_step_scaler,
                               o.local_step_clipper, last_step=recipe.train.steps - 1)


def _check_optimizer(recipe: Recipe) -> None:
    """[optimizer]: a known name; a compressed one only where it composes (ZeRO stage 0 or 1, no offload, pp = cp = 1)."""
    _choice("optimizer.name", recipe.optimizer.name, OPTIMIZERS)
    settings, par = compression_of(recipe), recipe.parallel
    if settings is None:
        return
    if getattr(par, "cp", 1) != 1:
        raise RecipeError(f"optimizer.name = {settings.name!r} with parallel.cp = {par.cp} is not supported; "
                          "valid: parallel.cp = 1")
    try:
        check_settings(settings, dp=par.dp, tp=par.tp, pp=par.pp, zero_stage=recipe.zero.stage,
                       offload=recipe.zero.offload)
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _check_nodes(recipe: Recipe) -> None:
    """parallel.node_size fits the layout (when given) and zero.shard_group / zero.hpz fit the stage."""
    from megazoo.parallel.topology import check_node_size  # torch: see _check_with_torch
    from megazoo.parallel.zero.groups import check_shard_choice
    par, zero = recipe.parallel, recipe.zero
    try:
        check_node_size(par.node_size, par.dp, par.tp, par.pp, par.dp * par.tp * par.pp * par.cp, par.cp)
        if zero.shard_group != "dp" or zero.hpz or zero.quantized_weights or zero.quantized_gradients != "none":
            check_shard_choice(zero.shard_group, zero.hpz, zero.stage, par.cp, zero.quantized_weights,
                               zero.quantized_gradients, zero.offload)
        if zero.quantized_gradients != "none" and recipe.optimizer.name != "adamw":
            raise ValueError(f"zero.quantized_gradients = {zero.quantized_gradients!r} with optimizer.name = "
                             f"{recipe.optimizer.name!r} is not supported (it compresses its own gradient "
                             "exchange); valid: optimizer.name = 'adamw' or zero.quantized_gradients = 'none'")
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _check_with_torch(recipe: Recipe, cfg: ModelConfig) -> None:
    """The checks whose code sits in modules that import torch (the context layout, node sizes and ZeRO sharding,
    the kernels), run last: every other mistake is reported without loading torch (seconds under load; a typo'd
    key or `--set parallel.tp=3` answers at once, tests/recipes/test_cli.py)."""
    from megazoo.parallel.context.layout import check_context_layout
    from megazoo.parallel.expert.layout import check_expert_parallel
    par = recipe.parallel
    try:  # seq_len divisible by 2 x cp, local heads by cp for all_to_all (parallel/context/layout.py)
        check_context_layout(par.cp, par.cp_attention, recipe.train.seq_len, cfg.n_head // par.tp, cfg.attn_dropout,
                             cfg.attention, cfg.sliding_window)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    try:  # ep divides the experts and dp x cp; top-k fits; the ZeRO choice partitions experts (parallel/expert)
        check_expert_parallel(par.ep, par.dp, par.cp, getattr(cfg, "n_experts", 0), getattr(cfg, "moe_top_k", 0),
                              model=cfg.name, shard_group=recipe.zero.shard_group, hpz=recipe.zero.hpz,
                              quantized_gradients=recipe.zero.quantized_gradients, optimizer=recipe.optimizer.name,
                              lora=recipe.lora.enabled, zero_stage=recipe.zero.stage)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    if getattr(cfg, "moe_seq_aux_loss_coef", 0) and par.cp > 1:  # models/moe/block.py refuses it too, later
        raise RecipeError(f"model.moe_seq_aux_loss_coef = {cfg.moe_seq_aux_loss_coef} (DeepSeek-V3's sequence-wise "
                          f"loss) is not built for parallel.cp = {par.cp}, which splits each sequence; valid: "
                          "moe_seq_aux_loss_coef = 0 or cp = 1")
    _check_mtp(recipe, cfg)
    _check_node_limit(recipe, cfg)
    _check_nodes(recipe)
    try:
        recipe.kernels.choice()
    except ValueError as err:
        raise RecipeError(f"[kernels]: {err}") from None


def _check_mtp(recipe: Recipe, cfg: ModelConfig) -> None:
    """Multi-token prediction shifts each row by 1 + depth tokens (models/deepseek/mtp.py): a row split over cp
    ranks or packed with several examples would shift across a boundary."""
    depth = getattr(cfg, "mtp_depth", 0)
    if depth and recipe.parallel.cp > 1:
        raise RecipeError(f"model.mtp_depth = {depth} (multi-token prediction) is not built for parallel.cp = "
                          f"{recipe.parallel.cp}, which splits each sequence; valid: mtp_depth = 0 or cp = 1")
    if depth and recipe.sft.path and recipe.sft.packing:
        raise RecipeError(f"model.mtp_depth = {depth} (multi-token prediction) with sft.packing = true would "
                          "predict across packed examples; valid: sft.packing = false or mtp_depth = 0")


def _check_node_limit(recipe: Recipe, cfg: ModelConfig) -> None:
    """DeepSeek-V3's node limit (model.moe_max_nodes of model.moe_nodes) means what it says under expert
    parallelism only when each node group's experts (n_experts / moe_nodes, in order) sit on one node: whole ep
    ranks (ep a multiple of moe_nodes) whose processes share a node (parallel.node_size, when given)."""
    nodes, par = getattr(cfg, "moe_nodes", 1), recipe.parallel
    if not getattr(cfg, "moe_max_nodes", 0) or par.ep == 1:
        return
    if par.ep % nodes:
        raise RecipeError(f"model.moe_nodes = {nodes} does not divide parallel.ep = {par.ep}: each node's experts "
                          f"must be whole ep ranks' (ep / moe_nodes of them); valid moe_nodes: "
                          f"{[d for d in range(1, par.ep + 1) if par.ep % d == 0 and cfg.n_experts % d == 0]}")
    if not par.node_size:
        return  # not known: one node (the resolver's node_size check covers the rest)
    per_node = par.node_size // par.tp  # dp x cp positions per node (node_size holds whole tp x cp groups)
    ranks_per_node, grad = par.ep // nodes, par.dp * par.cp
    for p in range(par.pp):
        for first in range(0, grad, ranks_per_node):  # one node group's ep ranks: consecutive dp x cp positions
            spanned = {(p * grad + m) // per_node for m in range(first, first + ranks_per_node)}
            if len(spanned) > 1:
                raise RecipeError(f"model.moe_nodes = {nodes} with parallel.ep = {par.ep}: a node group's "
                                  f"{ranks_per_node} ep ranks span {len(spanned)} nodes at parallel.node_size = "
                                  f"{par.node_size} (tp = {par.tp}); valid: a node_size holding "
                                  f"{ranks_per_node} x tp = {ranks_per_node * par.tp} processes (or a multiple), "
                                  "or moe_nodes = ep / (ep ranks per node)")


def _check_fb_overlap(recipe: Recipe, cfg: ModelConfig) -> None:
    """parallel.fb_overlap: DualPipe-V's forward/backward overlap (parallel/pipeline/fb_overlap.py) hides the
    all-to-alls of expert parallelism, so it needs both. It runs the decoder chunks as sub-stages
    (recipes/training/model_setup.overlap_sub_stages), which do not cover what is listed below (autocast they do:
    each compute sub-stage runs under it)."""
    par, train = recipe.parallel, recipe.train
    if not par.fb_overlap:
        return
    if par.schedule != "dualpipev":
        raise RecipeError(f"parallel.fb_overlap = true needs parallel.schedule = 'dualpipev' (got "
                          f"{par.schedule!r}): only its steady state pairs one micro-batch's forward with "
                          "another's backward; valid: schedule = 'dualpipev', or fb_overlap = false")
    if par.ep < 2:
        raise RecipeError(f"parallel.fb_overlap = true needs parallel.ep >= 2 (got ep = {par.ep}): it hides the "
                          "expert all-to-alls, and without expert parallelism there are none; valid: ep >= 2, or "
                          "fb_overlap = false")
    coefs = cfg.moe_aux_loss_coef or cfg.moe_z_loss_coef or cfg.moe_seq_aux_loss_coef
    uncovered = [(f, v, valid) for f, v, bad, valid in (
        ("train.activation_checkpointing", True, train.activation_checkpointing, "false"),
        ("train.fused_loss", train.fused_loss, train.fused_loss != "off", "'off'"),
        ("train.fp8", train.fp8, train.fp8 != "none", "'none'"),
        ("lora.rank", recipe.lora.rank, recipe.lora.rank > 0, "0"),
        ("sft.path", recipe.sft.path, bool(recipe.sft.path), "'' (pre-training rows; no packing)"),
        ("model.mtp_depth", cfg.mtp_depth, cfg.mtp_depth > 0, "0"),
        ("model.moe_capacity_factor", cfg.moe_capacity_factor, cfg.moe_capacity_factor > 0, "0 (dropless)"),
        ("model.dropout", cfg.dropout, cfg.dropout > 0, "0"),
        ("model.attn_dropout", cfg.attn_dropout, cfg.attn_dropout > 0, "0"),
        ("parallel.cp", par.cp, par.cp > 1, "1"),
        ("parallel.sequence_parallel", True, par.sequence_parallel, "false"),
        ("model.moe_aux_loss_scope", cfg.moe_aux_loss_scope, cfg.moe_aux_loss_scope == "model" and coefs,
         "'layer' (the model scope with non-zero coefficients)")) if bad]
    if uncovered:
        field, value, valid = uncovered[0]
        raise RecipeError(f"parallel.fb_overlap = true: {field} = {value!r} is not covered by the sub-staged decoder "
                          f"chunks (recipes/training/model_setup.overlap_sub_stages); valid: {valid}, or "
                          "fb_overlap = false")
