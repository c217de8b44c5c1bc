"""Where a LoRA run's weights come from: the frozen base from `checkpoint.load`, the adapters from their own
initialisation, a PEFT adapter folder (`lora.adapter`) or, on resume, the run's own checkpoints.

A LoRA run's checkpoints hold only what it trains (the adapters, their Adam moments, the step and the random
streams): the base never changes, so it is read again from `checkpoint.load` on every start, resume included, and
resuming is exact (tests/parallel/checkpoint/test_lora_checkpoint.py). Every function here is collective: every rank calls it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megazoo.models.config import architecture_mismatches
from megazoo.models.lora.peft_interop import read_peft_adapter
from megazoo.parallel.checkpoint.io import CheckpointError, latest_good_checkpoint, read_common, verify_checkpoint
from megazoo.parallel.checkpoint.load import load_views
from megazoo.parallel.tensor import unique_named_shards
from megazoo.parallel.zero.frozen import fill_views, frozen_views


def _named(trainer) -> list:
    named, seen = [], set()
    for chunk in trainer.chunks:
        for entry in unique_named_shards(chunk)[0]:
            if entry[0] not in seen:
                seen.add(entry[0])
                named.append(entry)
    return named


def checkpoint_dir(path: str | Path) -> Path:
    """A step_N directory as given, or a checkpoints folder's latest good one."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    found = latest_good_checkpoint(path, report=lambda *_: None)
    if found is None:
        raise CheckpointError(f"checkpoint.load = {path}: no good checkpoint there")
    return found


def load_base(trainer, path: str | Path) -> Path:
    """Fill the frozen base weights (any layout, ZeRO-3's partitions included) from the checkpoint at `path`."""
    path = checkpoint_dir(path)
    manifest = verify_checkpoint(path)
    mismatches = architecture_mismatches(read_common(path)["model"], dataclasses.asdict(trainer.res.model))
    if mismatches:
        raise CheckpointError(f"checkpoint {path} is for a different model: {'; '.join(mismatches)}")
    load_views(path, frozen_views(trainer.zero, _named(trainer), write=False), kinds=("param",), manifest=manifest)
    trainer.zero.after_load()
    return path


def import_adapter(trainer, adapter_dir: str | Path) -> None:
    """Start the adapters from a PEFT adapter folder (parameters and fp32 masters; Adam starts fresh)."""
    lora = trainer.res.recipe.lora
    theirs, state = read_peft_adapter(adapter_dir, trainer.res.model)
    ours = dataclasses.replace(lora, adapter="", dropout=theirs.dropout)
    if dataclasses.replace(theirs, adapter="") != ours:
        raise ValueError(f"lora.adapter = {adapter_dir}: its r = {theirs.rank}, lora_alpha = {theirs.alpha}, targets "
                         f"{list(theirs.targets)} differ from the recipe's lora.rank = {lora.rank}, lora.alpha = "
                         f"{lora.alpha}, lora.targets = {list(lora.targets)}")
    filled = fill_views(trainer.zero.state_views(), state, kinds=("param", "master"))
    if not filled and any(p.requires_grad for c in trainer.chunks for p in c.parameters()):
        raise ValueError(f"lora.adapter = {adapter_dir}: none of its tensors matched this model's adapters")
    trainer.zero.after_load()
