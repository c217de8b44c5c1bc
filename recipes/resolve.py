"""resolve(): every derived value of a recipe, computed once, and every check that needs no process.

Called before any process group exists, so a bad recipe fails fast with a message that names the field, the
value and what would be valid. A topology can be checked at its real size here: only arithmetic is involved.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path

from megazoo.data.indexed.formats import check_indexed
from megazoo.data.tokenizers.loading import check_tokenizer_spec, tokenizer_vocab_size
from megazoo.models.config import ModelConfig
from megazoo.models.presets import get_preset
from megazoo.models.layout import check_parallel_compat
from megazoo.models.lora.config import check_lora
from megazoo.parallel.fault_tolerance.config import check_diloco, check_fault_tolerance
from megazoo.parallel.pipeline.schedules import SPLIT_BACKWARD
from megazoo.recipes.checkpoint_model import (check_against_checkpoint, checkpoint_model, from_checkpoint,
                                              missing_load)
from megazoo.recipes.config import Recipe, RecipeError
from megazoo.recipes.layout_checks import (_check_optimizer, _check_pipeline, _check_with_torch, _choice, _positive,
                                            compression_of)  # noqa: F401 (compression_of: imported from here too)
from megazoo.recipes.sft_check import check_sft

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp64")
COMPILE_MODES = ("none", "blocks", "blocks:aot_eager")  # recipes/training/model_setup.py: compile_blocks
RUN_EXISTING = ("refuse", "start_over")  # run.existing
DATA_SOURCES = ("stdlib", "indexed", "synthetic")
WANDB_MODES = ("off", "offline", "online")


@dataclass(frozen=True)
class Resolved:
    recipe: Recipe
    model: ModelConfig  # preset after the recipe's overrides
    padded_vocab: int  # vocabulary rounded up to a multiple of 128 * tp
    global_batch: int  # sequences per optimizer step = micro_batch x grad_accum x dp
    world_size: int  # dp x tp x pp x cp
    stage_layers: list[list[int]]  # blocks of each pipeline (virtual) stage

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.recipe.train.seq_len

    @functools.cached_property
    def fused_loss(self) -> bool:
        """train.fused_loss resolved: "on", or "auto" where the planner finds that the fused head + loss lowers the
        peak of the rank holding the head (recipes/planner/fit.fused_loss_saves; its fused term is within 2% of the
        405B recipe's dry run) and nothing refuses it: not a split-backward schedule (which would drop the head's
        weight gradient), not LoRA (an adapted head runs the plain path), not MoE: the planner has no term yet for
        the experts' backward temporaries (issue 38), which the plain loss's larger backward peak covers and the
        fused one uncovers (qwen3-30b-a3b's 2-layer dry run: 5.5% over its plan with the fused loss, 2.4% under
        with the plain one)."""
        train, par = self.recipe.train, self.recipe.parallel
        if train.fused_loss != "auto":
            return train.fused_loss == "on"
        if (par.pp > 1 and par.schedule in SPLIT_BACKWARD) or self.recipe.lora.enabled or self.model.n_experts:
            return False
        from megazoo.recipes.planner.fit import fused_loss_saves  # the planner, only when asked

        return fused_loss_saves(self)

    @property
    def lr_decay_steps(self) -> int:
        t = self.recipe.train
        return t.lr_decay_steps if t.lr_decay_steps is not None else t.steps


def _unit_interval(where: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise RecipeError(f"{where} = {value!r} is invalid; valid: 0 <= value < 1")


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a collective that waits longer than a week is a hang, not a slow network
MIN_BPE_VOCAB = 257  # byte-level BPE: the 256 byte tokens plus the end-of-document token


def _check_run_and_sample(recipe: Recipe, global_batch: int) -> None:
    """Keys whose mistakes used to surface only after training (a crash in the closing sample loses the run)."""
    run_dir = Path(recipe.run.dir)
    if not recipe.run.dir.strip():
        raise RecipeError("run.dir is empty: give the folder the run writes to (e.g. runs/my-run)")
    _choice("run.existing", recipe.run.existing, RUN_EXISTING)
    if run_dir.exists() and not run_dir.is_dir():
        raise RecipeError(f"run.dir = {recipe.run.dir!r} is an existing file, not a folder: choose another path")
    sample = recipe.sample
    _positive("sample.tokens", sample.tokens, allow_zero=True)
    _positive("sample.top_k", sample.top_k, allow_zero=True)
    _positive("sample.temperature", sample.temperature, allow_zero=True)
    data, seq_len = recipe.data, recipe.train.seq_len
    if data.source == "stdlib":
        if data.vocab_size < MIN_BPE_VOCAB:
            raise RecipeError(f"data.vocab_size = {data.vocab_size} is too small for a byte-level BPE; valid: >= "
                              f"{MIN_BPE_VOCAB} (256 bytes + the end-of-document token)")
        # A byte-level BPE token covers at least one byte: fewer bytes than one global batch of samples can
        # never fill it, whatever the tokenizer learns.
        needed = (seq_len + 1) * global_batch
        if data.max_bytes * (1.0 - data.val_fraction) < needed:
            raise RecipeError(f"data.max_bytes = {data.max_bytes} cannot make one global batch: "
                              f"{global_batch} samples x {seq_len + 1} tokens need at least "
                              f"{math.ceil(needed / (1.0 - data.val_fraction))} bytes of corpus")


def _check_indexed(data, vocab_size: int) -> None:
    """Every dataset file exists and is sound (magic, sizes, checksums, token ids < the model's vocabulary)
    before any process starts."""
    if not data.paths:
        raise RecipeError("data.source = 'indexed' needs data.paths: the prefixes written by megazoo preprocess "
                          "(e.g. paths = [\"data/wiki_text_document\"])")
    if data.weights and len(data.weights) != len(data.paths):
        raise RecipeError(f"data.weights has {len(data.weights)} entries but data.paths has {len(data.paths)}; "
                          "give one weight per path or none (equal weights)")
    if any(w <= 0 for w in data.weights):
        raise RecipeError(f"data.weights = {list(data.weights)} is invalid: every weight must be > 0")
    datasets = [(key, prefix) for key in ("paths", "valid_paths") for prefix in getattr(data, key)]
    for key, prefix in datasets:  # every missing file first: the cheapest news
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise RecipeError(f"data.{key}: {prefix + suffix} does not exist (write it with "
                                  f"megazoo preprocess --output-prefix {prefix})")
    if data.tokenizer:
        try:
            check_tokenizer_spec(data.tokenizer)
        except (OSError, ValueError) as err:
            raise RecipeError(f"data.tokenizer = {data.tokenizer!r}: {err}") from None
        # model.vocab_size follows the tokenizer unless set; a smaller one could not embed every token id
        if (n := _tokenizer_vocab(data.tokenizer)) > vocab_size:
            raise RecipeError(f"model.vocab_size = {vocab_size} is smaller than the {n} tokens of data.tokenizer = "
                              f"{data.tokenizer!r}; valid: model.vocab_size >= {n}, or leave it unset (it follows "
                              "the tokenizer)")
    for key, prefix in datasets:
        try:
            check_indexed(prefix, vocab_size)  # magic, sizes, checksums (the .bin hash is cached), token ids
        except (OSError, ValueError) as err:
            hint = "" if "outside the vocabulary" not in str(err) else (
                f"; the model has {vocab_size} tokens (model.vocab_size"
                f"{', from data.tokenizer' if data.tokenizer else ''}): name the tokenizer the data was written "
                "with in data.tokenizer, or set model.vocab_size above the largest token id")
            raise RecipeError(f"data.{key}: {err}{hint}") from None


def _tokenizer_vocab(spec: str) -> int:
    try:
        return tokenizer_vocab_size(spec)
    except (OSError, ValueError) as err:
        raise RecipeError(f"data.tokenizer = {spec!r}: {err}") from None


def model_config(recipe: Recipe) -> ModelConfig:
    section = recipe.model
    try:
        preset = get_preset(section.preset)
        overrides = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
                     if f.name not in ("preset", "from_checkpoint", "from_hf")
                     and getattr(section, f.name) is not None}
        if section.from_hf:
            return _hf_model(recipe, overrides)
        if section.from_checkpoint:
            if not recipe.checkpoint.load:
                raise RecipeError("model.from_checkpoint = true needs checkpoint.load: the checkpoint whose "
                                  "architecture the model takes")
            step, saved = checkpoint_model(recipe.checkpoint.load)
            return from_checkpoint(saved, overrides, step)
        if recipe.data.source == "stdlib" and "vocab_size" not in overrides:
            overrides["vocab_size"] = recipe.data.vocab_size  # the BPE trained on the corpus sets the vocabulary
        if recipe.data.source == "indexed" and recipe.data.tokenizer and "vocab_size" not in overrides:
            overrides["vocab_size"] = _tokenizer_vocab(recipe.data.tokenizer)  # the data's tokenizer sets it
        return preset.replace(**overrides)
    except RecipeError:
        raise
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _hf_model(recipe: Recipe, overrides: dict) -> ModelConfig:
    """`model.from_hf = DIR`: the architecture of the HF folder's config.json (no weight is read here)."""
    from megazoo.models.hf.families import read_hf_config

    where = recipe.model.from_hf
    if recipe.model.from_checkpoint or recipe.checkpoint.load:
        raise RecipeError(f"model.from_hf = {where!r} names the starting weights, and so does "
                          f"{'model.from_checkpoint' if recipe.model.from_checkpoint else 'checkpoint.load'}: "
                          "give one of them")
    try:
        cfg = read_hf_config(where)[1]
    except (OSError, ValueError) as err:
        raise RecipeError(f"model.from_hf = {where!r}: {err}") from None
    return from_checkpoint(dataclasses.asdict(cfg), overrides, Path(where))


def resolve(recipe: Recipe, world_size: int | None = None, *, model: ModelConfig | None = None) -> Resolved:
    """Check the recipe against its own topology (and `world_size`, if known) and derive what follows. `model`,
    where given, is the architecture already worked out (resolve_for_planning's); else model_config(recipe)."""
    par, train, data = recipe.parallel, recipe.train, recipe.data
    for name in ("dp", "tp", "pp", "cp", "ep"):
        _positive(f"parallel.{name}", getattr(par, name))
    _positive("parallel.timeout_s", par.timeout_s)
    _positive("parallel.flight_recorder", par.flight_recorder, allow_zero=True)
    if par.timeout_s > MAX_TIMEOUT_S:
        raise RecipeError(f"parallel.timeout_s = {par.timeout_s} is invalid; valid: 0 < value <= {MAX_TIMEOUT_S:.0f} "
                          "(one week: a collective waiting longer is a hang)")
    cfg = model if model is not None else model_config(recipe)

    try:
        check_parallel_compat(cfg, par.tp, par.pp)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    try:
        check_lora(recipe.lora, cfg, par.tp)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    stages = _check_pipeline(recipe, cfg)
    layout = par.dp * par.tp * par.pp * par.cp
    ft = recipe.fault_tolerance
    try:  # before the process count: with fault tolerance each replica group's processes are one job
        check_fault_tolerance(ft, dp=par.dp, zero_stage=recipe.zero.stage, shard_group=recipe.zero.shard_group,
                              optimizer=recipe.optimizer.name)
        z = recipe.zero
        check_diloco(recipe.diloco, dp=par.dp, tp=par.tp, cp=par.cp, ep=par.ep, node_size=par.node_size,
                     zero_stage=z.stage, shard_group=z.shard_group, offload=z.offload,
                     quantized_gradients=z.quantized_gradients, optimizer=recipe.optimizer.name, ft_enabled=ft.enabled)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    if ft.enabled and world_size is not None and world_size not in (layout, layout // ft.replica_groups):
        raise RecipeError(f"fault_tolerance: {world_size} processes were started, but each of the "
                          f"{ft.replica_groups} replica groups runs {layout // ft.replica_groups} (parallel.dp / "
                          f"replica_groups x tp x pp x cp) and all of them {layout}")
    if world_size is not None and world_size != layout and not ft.enabled:
        cp = f" x cp={par.cp}" if par.cp > 1 else ""
        raise RecipeError(f"parallel dp={par.dp} x tp={par.tp} x pp={par.pp}{cp} = {layout} processes, but "
                          f"{world_size} were started; start {layout} (--nproc {layout}) or change the layout")
    if par.sequence_parallel and par.tp < 2:
        raise RecipeError(f"parallel.sequence_parallel = true with parallel.tp = {par.tp}: it splits the sequence over "
                          "the tensor-parallel group; valid: parallel.tp >= 2, or sequence_parallel = false")
    if par.sequence_parallel and (recipe.train.seq_len // par.cp) % par.tp:
        raise RecipeError(f"parallel.sequence_parallel: train.seq_len = {recipe.train.seq_len} / cp {par.cp} is not "
                          f"divisible by parallel.tp = {par.tp}; valid: a seq_len that is a multiple of cp x tp "
                          f"({par.cp * par.tp})")

    for name in ("steps", "micro_batch", "grad_accum", "seq_len", "eval_batches"):
        _positive(f"train.{name}", getattr(train, name))
    for name in ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "min_lr"):
        _positive(f"train.{name}", getattr(train, name), allow_zero=True)
    _positive("train.lr", train.lr)
    _unit_interval("train.beta1", train.beta1)
    _unit_interval("train.beta2", train.beta2)
    _positive("train.eps", train.eps)
    if train.min_lr > train.lr:
        raise RecipeError(f"train.min_lr = {train.min_lr} is larger than train.lr = {train.lr}")
    if train.lr_decay_steps is not None:
        _positive("train.lr_decay_steps", train.lr_decay_steps)
    global_batch = train.micro_batch * train.grad_accum * par.dp
    if train.global_batch is not None and train.global_batch != global_batch:
        raise RecipeError(
            f"train.global_batch = {train.global_batch} does not equal train.micro_batch x train.grad_accum x "
            f"parallel.dp = {train.micro_batch} x {train.grad_accum} x {par.dp} = {global_batch}; set it to "
            f"{global_batch}, remove it, or change micro_batch / grad_accum / dp")
    if train.seq_len > cfg.n_positions:
        raise RecipeError(f"train.seq_len = {train.seq_len} exceeds the {cfg.n_positions} positions of {cfg.name} "
                          f"(model.n_positions); valid: 1..{cfg.n_positions}")
    if recipe.zero.stage not in (0, 1, 2, 3):
        raise RecipeError(f"zero.stage = {recipe.zero.stage} is invalid; valid: 0, 1, 2, 3")
    _positive("zero.reduce_bucket_size", recipe.zero.reduce_bucket_size)
    _choice("zero.offload", recipe.zero.offload, ("none", "cpu"))
    _check_optimizer(recipe)
    if recipe.zero.offload == "cpu" and recipe.zero.stage == 0:
        raise RecipeError("zero.offload = 'cpu' needs zero.stage >= 1 (only partitioned optimizer states are "
                          "offloaded); valid: zero.stage = 1, 2 or 3, or zero.offload = 'none'")
    _positive("checkpoint.every", recipe.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", recipe.checkpoint.keep)
    _choice("checkpoint.format", recipe.checkpoint.format, ("megazoo", "dcp"))
    if recipe.checkpoint.format == "dcp" and recipe.checkpoint.async_save:
        raise RecipeError("checkpoint.async_save = true writes the native format only; with checkpoint.format = "
                          "'dcp' set async_save = false, or use checkpoint.format = 'megazoo'")
    if recipe.checkpoint.load and not Path(recipe.checkpoint.load).exists():
        raise missing_load(recipe.checkpoint.load)  # where it was looked for, and how to point at it
    if recipe.checkpoint.load:
        check_against_checkpoint(cfg, recipe.checkpoint.load)  # every mismatch at once, before any process
    ls = recipe.loss_scale
    for name in ("initial_scale", "min_scale", "growth_interval", "hysteresis", "max_consecutive_skips"):
        _positive(f"loss_scale.{name}", getattr(ls, name))
    _choice("train.precision", train.precision, PRECISIONS)
    _choice("train.compile", train.compile, COMPILE_MODES)
    _choice("train.fused_loss", train.fused_loss, ("auto", "on", "off"))
    if train.fp8 != "none":  # parallel/tensor/fp8.py imports torch: only a recipe that asks for FP8 loads it here
        from megazoo.parallel.tensor.fp8 import RECIPES as FP8_RECIPES, fp8_problem

        _choice("train.fp8", train.fp8, ("none", *FP8_RECIPES))
        if why := fp8_problem(cfg, par.tp, train.precision, recipe.lora.enabled):
            raise RecipeError(f"train.fp8 = {train.fp8!r} is unsupported here: {why}; or set train.fp8 = 'none'")
    if recipe.zero.fp8_all_gather and (recipe.zero.stage != 3 or train.fp8 != "tensorwise" or recipe.zero.hpz
                                       or recipe.zero.quantized_weights):
        raise RecipeError(f"zero.fp8_all_gather = true needs zero.stage = 3 and train.fp8 = 'tensorwise' without "
                          f"zero.hpz / zero.quantized_weights (got stage {recipe.zero.stage}, train.fp8 = "
                          f"{train.fp8!r}, hpz = {recipe.zero.hpz}, quantized_weights = "
                          f"{recipe.zero.quantized_weights}); valid: those, or zero.fp8_all_gather = false")
    if train.fused_loss == "on" and par.pp > 1 and par.schedule in SPLIT_BACKWARD:
        raise RecipeError(f"train.fused_loss = 'on' with parallel.schedule = {par.schedule!r} (pp = {par.pp}): its split "
                          "backward would drop the head's weight gradient; valid: fused_loss = 'auto' or 'off', or "
                          "a schedule of 'gpipe', '1f1b', 'interleaved'")
    _choice("data.source", data.source, DATA_SOURCES)
    _choice("logging.wandb", recipe.logging.wandb, WANDB_MODES)
    if not 0.0 <= data.val_fraction < 1.0:
        raise RecipeError(f"data.val_fraction = {data.val_fraction} is invalid; valid: 0 <= value < 1")
    _positive("data.vocab_size", data.vocab_size)
    _positive("data.max_bytes", data.max_bytes)
    _positive("data.synthetic_tokens", data.synthetic_tokens)
    if data.source == "indexed":
        _check_indexed(data, cfg.vocab_size)
    if data.source == "stdlib" and cfg.vocab_size < data.vocab_size:
        raise RecipeError(f"model.vocab_size = {cfg.vocab_size} is smaller than the tokenizer's data.vocab_size = "
                          f"{data.vocab_size}; valid: model.vocab_size >= {data.vocab_size}")
    _check_run_and_sample(recipe, global_batch)
    check_sft(recipe.sft, seq_len=train.seq_len, vocab_size=cfg.vocab_size, cp=par.cp, attention=cfg.attention,
              mtp_depth=cfg.mtp_depth)
    _check_with_torch(recipe, cfg)
    return Resolved(recipe=recipe, model=cfg, padded_vocab=cfg.padded_vocab(par.tp), global_batch=global_batch,
                    world_size=layout, stage_layers=stages)


def resolve_for_planning(recipe: Recipe) -> Resolved:
    """The recipe as planning reads it (`plan --recipe`, `plan --dry-run`, `reproduce claims`): only its architecture
    and layout matter, so its corpus, tokenizer and checkpoint need not exist on this machine. The vocabulary is the
    tokenizer's where that is a file at hand, else the preset's (or model.vocab_size): planning stays offline, so a
    Hugging Face `hf:` tokenizer counts as not at hand. A checkpoint the model takes its architecture from
    (model.from_checkpoint) must exist; an HF folder (model.from_hf) not at hand is stood in for by the preset the
    recipe names. The returned recipe reads synthetic data and loads no checkpoint."""
    data = recipe.data
    if recipe.model.from_hf and not Path(recipe.model.from_hf).exists():  # the preset stands for the HF folder
        recipe = replace(recipe, model=replace(recipe.model, from_hf=""))
    at_hand = bool(data.tokenizer) and not data.tokenizer.startswith("hf:") and Path(data.tokenizer).exists()
    model = model_config(replace(recipe, data=replace(data, tokenizer=data.tokenizer if at_hand else "")))
    bare_data = replace(data, source="synthetic", paths=(), valid_paths=(), tokenizer="")
    keep_load = recipe.checkpoint.load if recipe.model.from_checkpoint else ""
    bare = replace(recipe, data=bare_data, checkpoint=replace(recipe.checkpoint, load=keep_load),
                   sft=replace(recipe.sft, path="", valid_path=""))
    return resolve(bare, model=model)
