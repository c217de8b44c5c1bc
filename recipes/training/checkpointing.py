"""The training run's checkpoints: what a Trainer saves and loads, and where a run starts from.

The format and its guarantees (pieces by global name + tp layout + flat range, manifest with sha256, atomic
publish, keep-K, fall back to the last good one) are parallel/checkpoint's; this module only says what a
training run puts in it: the optimizer's state views, the step, the loss scaler, the recipe, the model's shape
and each rank's random streams. Every function here is collective: every rank calls it.

Resuming (checkpoint.resume) never starts over on top of damaged checkpoints: when some exist and none verifies,
restore() raises naming each one and why. It also refuses a changed train.micro_batch, train.seq_len or global
batch unless the recipe sets checkpoint.allow_batch_change = true (a weights-only fine-tune start may change it).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from megazoo.data.tokenizers.store import tokenizer_record
from megazoo.models.config import architecture_mismatches
from megazoo.parallel import accelerator
from megazoo.parallel.checkpoint.async_save import AsyncCheckpointSaver
from megazoo.parallel.checkpoint.io import (CheckpointError, latest_good_checkpoint, load_tensor_file, read_common,
                                            save_checkpoint, verify_checkpoint)
from megazoo.parallel.checkpoint.load import load_views
from megazoo.parallel.checkpoint.views import StateView, optimizer_steps, set_optimizer_steps
from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.interface import ZeroOptimizer
from megazoo.recipes.resolve import Resolved
from megazoo.recipes.training.data_setup import TrainData


class TrainingRun(Protocol):
    """What a checkpoint reads and restores of a training run: recipes/training/trainer.py's Trainer. The Trainer
    imports this module (its save and load delegate here), so it is described here, not imported."""

    res: Resolved
    topo: Topology
    model: torch.nn.Module  # the first pipeline chunk (the whole model when pp = 1)
    zero: ZeroOptimizer
    scaler: Any  # recipes/training/model_setup.py's loss scaler, or None
    data: TrainData  # its tokenizer is recorded with the checkpoint

def layout(res: Resolved) -> dict:
    """The parallel layout a checkpoint was written in (loading into another one reshards)."""
    par = res.recipe.parallel
    return {"dp": par.dp, "tp": par.tp, "pp": par.pp, "virtual_stages": par.virtual_stages,
            "zero_stage": res.recipe.zero.stage, "stage_layers": res.stage_layers,
            **({"cp": par.cp} if par.cp > 1 else {})}  # cp only when used: older manifests still match


def state_views(trainer: TrainingRun) -> list[StateView]:
    """What this rank saves/loads; each value is written by exactly one rank: replicas over dp (handled by
    the optimizer), over tp (tensors not split by tp: tp rank 0) and over pp (the tied embedding: stage 0)."""
    topo = trainer.topo
    views = trainer.zero.state_views() + _buffer_views(trainer)
    for view in views:
        if view.spec.dim is None and topo.tp_rank != 0:
            view.write = False
        if view.name == "wte.weight" and topo.pp > 1 and not topo.is_first_stage:
            view.write = False
    return views


def _buffer_views(trainer: TrainingRun) -> list[StateView]:
    """The state that trains without the optimizer: DeepSeek-V3's routing bias (router.expert_bias, moved after
    each step from the load; models/moe/router.py), replicated, saved as a "param" by the first data-parallel rank
    of each stage and loaded in place at any layout."""
    return [StateView(name, ShardSpec(tuple(buf.shape)), "param", 0, buf.numel(), buf.view(-1),
                      write=trainer.topo.grad_rank == 0)
            for chunk in trainer.chunks for name, buf in chunk.named_buffers() if name.endswith("router.expert_bias")]


def _rng_state(trainer: TrainingRun) -> dict:
    # The device type tags the streams: a CUDA generator's state means nothing to a CPU one (and vice versa).
    state = {"cpu": torch.get_rng_state(), "tp": trainer.model.rng.get_state(),
             "device": torch.tensor(list(trainer.topo.device.type.encode()), dtype=torch.uint8)}
    if trainer.topo.device.type == "cuda":
        state["cuda"] = accelerator.rng_state(trainer.topo.device)
    return state


def _set_rng_state(trainer: TrainingRun, rng: dict) -> None:
    """Resume this rank's random streams, when they were saved on the same kind of device: a CPU run resumed on
    a GPU (or back) starts fresh device streams instead of feeding one generator's state to the other."""
    saved_on = bytes(rng["device"].tolist()).decode() if "device" in rng else "cpu"
    if saved_on != trainer.topo.device.type:
        return
    torch.set_rng_state(rng["cpu"])
    trainer.model.rng.set_state(rng["tp"])
    if "cuda" in rng and trainer.topo.device.type == "cuda":
        accelerator.set_rng_state(rng["cuda"], trainer.topo.device)


def _optimizer_extras(trainer: TrainingRun) -> dict:
    """Per-rank optimizer state outside the views (1-bit / 0-1 Adam's error buffers: parallel/compressed/)."""
    return {"optimizer": trainer.zero.rank_state()} if hasattr(trainer.zero, "rank_state") else {}


def save(trainer: TrainingRun, step: int, phase=None) -> Path:
    """Save the state after `step` completed steps under run.dir/checkpoints; `phase(what)`: told as this rank
    enters each part of the save (parallel/checkpoint/io.py's save_checkpoint)."""
    res = trainer.res
    common = {"step": step, "optimizer_steps": optimizer_steps(trainer.zero.optimizer),
              "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
              "recipe": res.recipe.to_dict(), "model": dataclasses.asdict(res.model),
              "global_batch": res.global_batch,  # plain data: written as common.json
              # the folder this run started in: relative paths of its recipe (checkpoint.load, a LoRA run's base)
              # meant that folder, so readers elsewhere resolve them there (models/lora/checkpoint.py)
              "workdir": os.getcwd()}
    sft_manifest = getattr(getattr(getattr(trainer.data, "train", None), "examples", None), "manifest", None)
    if isinstance(sft_manifest, dict) and sft_manifest.get("template"):  # `megazoo generate --chat` prompts in it
        common["chat_template"] = sft_manifest["template"]
    tokenizer = getattr(trainer.data, "tokenizer", None)
    if tokenizer is not None:  # eval, export and generate take it from here (data/tokenizers/store.py)
        common["tokenizer"] = tokenizer_record(tokenizer)
    written_layout = layout(res)
    extras = {"rng": _rng_state(trainer), "layout": written_layout, **_optimizer_extras(trainer)}
    if res.recipe.checkpoint.format == "dcp":  # torch.distributed.checkpoint files (parallel/checkpoint/dcp_views.py)
        from megazoo.parallel.checkpoint.dcp_views import save_dcp_checkpoint, vocab_rows
        views = state_views(trainer)
        return save_dcp_checkpoint(Path(res.recipe.run.dir) / "checkpoints", step, views, extras=extras,
                                   common=common, layout=written_layout, keep=res.recipe.checkpoint.keep,
                                   clip_rows=vocab_rows(views, res.model.vocab_size),
                                   verify=res.recipe.checkpoint.verify_on_save)
    write, more = save_checkpoint, {"phase": phase} if phase is not None else {}
    if res.recipe.checkpoint.async_save:  # returns after the copy to host memory; see wait_for_save
        write, more = async_saver(trainer).save, {}
    return write(Path(res.recipe.run.dir) / "checkpoints", step, state_views(trainer),
                 extras=extras, common=common, layout=written_layout, keep=res.recipe.checkpoint.keep,
                 verify=res.recipe.checkpoint.verify_on_save, **more)


def async_saver(trainer: TrainingRun) -> AsyncCheckpointSaver:
    """The run's background checkpoint writer (checkpoint.async_save), made at its first save."""
    saver = getattr(trainer, "checkpoint_saver", None)
    if saver is None:
        saver = trainer.checkpoint_saver = AsyncCheckpointSaver(trainer.topo.device)
    return saver


def wait_for_save(trainer: TrainingRun) -> None:
    """Collective: the background save in flight (if any) is published, or its error raised on every rank."""
    saver = getattr(trainer, "checkpoint_saver", None)
    if saver is not None:
        saver.wait()


def abandon_save(trainer: TrainingRun, report=print) -> None:
    """After an exception (no collective): wait for this rank's background write and report its error."""
    saver = getattr(trainer, "checkpoint_saver", None)
    error = saver.abandon() if saver is not None else None
    if error:
        report(f"megazoo: the background checkpoint save failed too: {error}")


def load(trainer: TrainingRun, path: str | Path, *, load_optimizer: bool = True) -> int:
    """Load a checkpoint saved at any layout; returns the step to continue from (0 for weights only)."""
    path = Path(path)
    manifest = verify_checkpoint(path)  # every file's size and sha256, once
    common = read_common(path)
    mismatches = architecture_mismatches(common["model"], dataclasses.asdict(trainer.res.model))
    if mismatches:
        raise CheckpointError(f"checkpoint {path} is for a different model: {'; '.join(mismatches)}")
    wait_for_save(trainer)  # a background save of this run may be writing the very checkpoint asked for
    views, kinds = state_views(trainer), None if load_optimizer else ("param", "master")
    if manifest.get("storage") == "dcp":  # a checkpoint.format = "dcp" checkpoint: DCP reshards it
        from megazoo.parallel.checkpoint.dcp_views import load_views_dcp, vocab_rows
        try:
            load_views_dcp(path, views, vocab_rows(views, trainer.res.model.vocab_size), kinds=kinds)
        except ValueError as err:
            raise CheckpointError(str(err)) from None
    else:
        load_views(path, views, kinds=kinds, manifest=manifest)
    trainer.zero.after_load()
    if not load_optimizer:
        return 0
    set_optimizer_steps(trainer.zero.optimizer, common["optimizer_steps"])
    if trainer.scaler is not None and common["scaler"] is not None:
        trainer.scaler.load_state_dict(common["scaler"])
    rank_state = None
    if manifest["layout"] == layout(trainer.res) and manifest["world_size"] == trainer.topo.world_size:
        # Same layout: every rank resumes its own random streams, so dropout continues bit-identically.
        file = path / f"rank{trainer.topo.rank:05d}.pt"
        try:
            extras = load_tensor_file(file)["extras"]
            rng = extras["rng"]
        except (KeyError, TypeError) as err:
            raise CheckpointError(f"checkpoint file {file} holds no random state: {err!r}") from None
        _set_rng_state(trainer, rng)
        rank_state = extras.get("optimizer")
    if hasattr(trainer.zero, "load_rank_state"):  # another layout: compression error buffers restart at zero
        trainer.zero.load_rank_state(rank_state)
    return common["step"]


def load_hf(trainer: TrainingRun, folder: str | Path, views=None) -> int:
    """`model.from_hf`: this rank's parameter views (its tp / pp / ZeRO-3 slices) filled straight from the HF
    safetensors files (models/hf/converter.py); returns the bytes this rank read."""
    from megazoo.models.hf.converter import fill_views_from_hf
    from megazoo.models.hf.families import family_of_config
    from megazoo.models.hf.safetensors_files import HFWeights

    weights = HFWeights(folder)
    views = state_views(trainer) if views is None else views
    fill_views_from_hf(weights, family_of_config(trainer.res.model), trainer.res.model, views)
    trainer.zero.after_load()
    return weights.bytes_read


def load_dcp_weights(trainer: TrainingRun, folder: str | Path) -> str:
    """checkpoint.load = a DCP folder no megazoo run wrote (torchtitan's, or `megazoo convert megazoo-to-dcp`'s):
    this rank's parameter views filled through the family's key map (torchtitan's names and q / k order,
    models/hf/llama.py), each rank cutting its own tp / pp / ZeRO slices; weights only. Returns which names."""
    from megazoo.models.hf.convert_dcp import dcp_family
    from megazoo.models.hf.converter import fill_views_from_hf
    from megazoo.models.hf.families import family_of_config
    from megazoo.parallel.checkpoint.dcp import DCPReader

    cfg = trainer.res.model
    reader = DCPReader(folder)
    names, family = dcp_family(reader, family_of_config(cfg), cfg)
    try:
        fill_views_from_hf(reader, family, cfg, state_views(trainer))
    except ValueError as err:
        raise CheckpointError(f"checkpoint.load = {folder} ({names} DCP names): {err}") from None
    trainer.zero.after_load()
    return names


def batch_changes(res: Resolved, common: dict) -> list[str]:
    """What differs between the batch a checkpoint was trained with and this recipe's: 'key = old there, new
    here' for train.micro_batch, train.seq_len and the global batch (micro_batch x grad_accum x dp)."""
    saved = common.get("recipe") or {}
    changes = []
    for section, key in (("train", "micro_batch"), ("train", "seq_len")):
        old, new = (saved.get(section) or {}).get(key), getattr(getattr(res.recipe, section), key)
        if old is not None and old != new:
            changes.append(f"{section}.{key} = {old} in the checkpoint, {new} now")
    old = common.get("global_batch")
    if old is not None and old != res.global_batch:
        changes.append(f"global batch (micro_batch x grad_accum x dp) = {old} in the checkpoint, {res.global_batch} now")
    return changes


def schedule_changes(res: Resolved, common: dict) -> list[str]:
    """'train.steps = 100 in the checkpoint, 200 now' for each learning-rate schedule key a resumed run changed
    (train.steps also moves the end of the cosine decay unless train.lr_decay_steps is set)."""
    saved = (common.get("recipe") or {}).get("train") or {}
    changes = []
    for key in ("steps", "lr_decay_steps", "warmup_steps", "lr", "min_lr"):
        old, new = saved.get(key), getattr(res.recipe.train, key)
        if key in saved and old != new:
            changes.append(f"train.{key} = {old} in the checkpoint, {new} now")
    return changes


def check_batch_unchanged(res: Resolved, path: Path, common: dict, report=print) -> None:
    """Resuming the same run with another batch shape changes its data order and schedule: refused unless the
    recipe sets checkpoint.allow_batch_change = true (then only reported)."""
    changes = batch_changes(res, common)
    if not changes:
        return
    if getattr(res.recipe.checkpoint, "allow_batch_change", False):
        report(f"megazoo: resuming {path} with a changed batch ({'; '.join(changes)}): allowed by "
               "checkpoint.allow_batch_change = true")
        return
    raise CheckpointError(f"checkpoint.resume: {path} was trained with another batch: {'; '.join(changes)}. Keep "
                          "the old values, or set checkpoint.allow_batch_change = true to continue anyway")


def restore(trainer: TrainingRun, report=print) -> int:
    """Where training starts: with checkpoint.resume, the latest good checkpoint of this run (any layout); else
    checkpoint.load (another run's checkpoint, or its checkpoints folder); else step 0."""
    ckpt, run_dir = trainer.res.recipe.checkpoint, Path(trainer.res.recipe.run.dir)
    lora = trainer.res.recipe.lora
    if lora.enabled and ckpt.load:  # LoRA: checkpoint.load is the frozen base, read on every start (resume too)
        from megazoo.recipes.training.lora_setup import load_base
        report(f"megazoo: LoRA base weights from {load_base(trainer, ckpt.load)}")
    elif lora.enabled and trainer.res.recipe.model.from_hf:  # the frozen base straight from the HF folder
        from megazoo.parallel.zero.frozen import frozen_views
        from megazoo.recipes.training.lora_setup import _named
        folder = trainer.res.recipe.model.from_hf
        read = load_hf(trainer, folder, frozen_views(trainer.zero, _named(trainer), write=False))
        report(f"megazoo: LoRA base weights from the HF folder {folder} ({read:,} bytes read by this rank)")
    if ckpt.resume:
        root, problems = run_dir / "checkpoints", []
        path = latest_good_checkpoint(root, report=report, problems=problems)
        if path is None and problems:  # never start over silently on top of damaged checkpoints
            raise CheckpointError(f"checkpoint.resume: no good checkpoint under {root}, and nothing there was "
                                  "changed:\n" + "\n".join(f"  - {p}" for p in problems) + "\nrepair or restore "
                                  "them, or use --overwrite to start over (the old run is moved aside)")
        if path is not None:
            common = read_common(path)
            check_batch_unchanged(trainer.res, path, common, report)
            for change in schedule_changes(trainer.res, common):
                report(f"megazoo: resuming with {change}: the learning-rate schedule from here on follows the new "
                       "value (warmup and cosine decay are functions of the step and these keys)")
            step = load(trainer, path)
            report(f"megazoo: resumed from {path} at step {step}")
            return step
        report(f"megazoo: no checkpoint under {run_dir / 'checkpoints'}: starting at step 0")
    if lora.enabled:  # the adapters start from their initialisation or from a PEFT adapter folder
        if lora.adapter:
            from megazoo.recipes.training.lora_setup import import_adapter
            import_adapter(trainer, lora.adapter)
            report(f"megazoo: LoRA adapters from the PEFT adapter {lora.adapter}")
        return 0
    if trainer.res.recipe.model.from_hf:
        folder, read = trainer.res.recipe.model.from_hf, load_hf(trainer, trainer.res.recipe.model.from_hf)
        report(f"megazoo: weights from the HF folder {folder} ({read:,} bytes read by this rank), at step 0")
        return 0
    if ckpt.load:
        path = Path(ckpt.load)
        if (path / ".metadata").is_file() and not (path / "manifest.json").is_file():  # a foreign DCP folder
            names = load_dcp_weights(trainer, path)
            report(f"megazoo: weights from the DCP folder {path} ({names} names), at step 0")
            return 0
        if not (path / "manifest.json").is_file():  # a checkpoints folder: its latest good checkpoint
            found = latest_good_checkpoint(path, report=report)
            if found is None:
                raise CheckpointError(f"checkpoint.load = {ckpt.load}: no good checkpoint there")
            path = found
        step = load(trainer, path, load_optimizer=ckpt.load_optimizer)
        report(f"megazoo: loaded {path} ({'with' if ckpt.load_optimizer else 'weights only, without'} "
               f"optimizer state), starting at step {step}")
        return step
    return 0
