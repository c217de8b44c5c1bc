"""A LoRA run's checkpoint as something to read: its `[lora]` settings and the base its adapters sit on.

A LoRA run's checkpoints hold only the adapters (recipes/training/lora_setup.py); the base is the run's
`checkpoint.load`, recorded as written in the checkpoint's recipe, e.g. a shipped recipe's relative
'runs/demo/checkpoints'. A relative one meant the folder the run was started from, not the reader's, so it is
resolved there: the folder that holds the run's relative `run.dir` above this checkpoint (which survives moving
the whole tree), else the working folder the run recorded (common.json's `workdir`). Not found there, the error
says it is the recorded base and how to name another (`--lora-base`). Plain data: no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from megazoo.models.lora.config import LoRAConfig


def lora_of_common(common: dict) -> LoRAConfig | None:
    """The `[lora]` a checkpoint was trained with (its common.json's recipe), or None for full fine-tuning."""
    table = (common.get("recipe") or {}).get("lora") or {}
    if not table.get("rank"):
        return None
    return LoRAConfig(**{**table, "targets": tuple(table.get("targets", ()))})


def started_in(step_dir: str | Path, run_dir: str) -> Path | None:
    """The folder a run with relative `run_dir` was started from, read off where its checkpoint `step_dir` sits
    (<folder>/<run_dir>/checkpoints/step_N); None when run_dir is absolute or the checkpoint is not there."""
    if not run_dir or os.path.isabs(run_dir):
        return None
    run_parts = Path(os.path.normpath(run_dir)).parts
    checkpoints = Path(os.path.abspath(step_dir)).parent
    run = checkpoints.parent
    if checkpoints.name != "checkpoints" or run_parts == (".",) or run.parts[-len(run_parts):] != run_parts:
        return None
    return Path(*run.parts[:-len(run_parts)])


def lora_base(common: dict, step_dir: str | Path, given: str | Path | None = None) -> Path:
    """The base checkpoint (a step directory or a checkpoints folder) of the LoRA checkpoint `step_dir` whose
    common.json is `common`: `given` (--lora-base) when set, else the recorded checkpoint.load resolved as the run
    resolved it (the module docstring). Raises naming the recorded value and --lora-base when it is not there."""
    if given:
        if not Path(given).exists():
            raise FileNotFoundError(f"--lora-base {given}: no such checkpoint (a step_N directory or a run's "
                                    "checkpoints folder)")
        return Path(given)
    recipe = common.get("recipe") or {}
    load = (recipe.get("checkpoint") or {}).get("load") or ""
    if not load:
        raise ValueError(f"checkpoint {step_dir} holds LoRA adapters only and its recipe names no checkpoint.load "
                         "(the base they sit on): pass --lora-base CKPT")
    if os.path.isabs(load):
        tried = [Path(load)]
    else:
        # a checkpoint from before megazoo recorded `workdir`: the reader's folder, as it was then resolved
        folders = [started_in(step_dir, (recipe.get("run") or {}).get("dir", "")),
                   common.get("workdir") or os.getcwd()]
        tried = list(dict.fromkeys(Path(os.path.normpath(Path(f) / load)) for f in folders if f))
    for path in tried:
        if path.exists():
            return path
    where = (", ".join(map(str, tried)) + " is not there") if tried else (
        "this checkpoint does not say which folder that run started in")
    raise FileNotFoundError(f"checkpoint {step_dir} holds LoRA adapters only; their base is what its run recorded, "
                            f"checkpoint.load = {load!r}, relative to the folder that run was started from: {where}. "
                            "Point at the base with --lora-base CKPT (a step_N directory or a checkpoints folder)")
