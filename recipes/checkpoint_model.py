"""The model a `checkpoint.load` holds, read before any process starts (resolve() calls this module).

A fine-tune that names a checkpoint of another shape used to fail only after launch, one mismatched key per
attempt. Here the checkpoint's common.json (plain data, a few KB: no tensor is read and nothing is hashed; the
trainer verifies every file when it loads) is compared with the recipe's model, every architecture mismatch is
listed at once, and `model.from_checkpoint = true` takes the architecture from the checkpoint instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from megazoo.models.config import ARCHITECTURE_FIELDS, ModelConfig, architecture_mismatches
from megazoo.recipes.config import RecipeError

_MANIFEST, _COMMON, _LATEST = "manifest.json", "common.json", "latest"


def _shipped_writer(load: str) -> str | None:
    """The shipped recipe whose run writes `load` (its run.dir, or run.dir/checkpoints), if one does."""
    import tomllib

    from megazoo.recipes.catalog import shipped_recipes

    wanted = os.path.normpath(load)
    for name, file in shipped_recipes().items():
        run_dir = tomllib.loads(file.read_text(encoding="utf-8")).get("run", {}).get("dir", "")
        if run_dir and wanted in (os.path.normpath(run_dir), os.path.normpath(os.path.join(run_dir, "checkpoints"))):
            return name
    return None


def missing_load(load: str) -> RecipeError:
    """checkpoint.load names nothing: say where it was looked for and how to point at it. A relative one names a
    run's output (a shipped recipe's `runs/...`), which lies in the folder that run was started from: megazoo
    resolves run.dir and checkpoint.load against the folder `megazoo train` runs in, as that run did."""
    message = f"checkpoint.load = {load!r} does not exist"
    if not os.path.isabs(load):
        message += (f" in the current folder {os.getcwd()} (run.dir and checkpoint.load are relative to the folder "
                    "`megazoo train` runs in, as they were for the run that wrote it)")
        writer = _shipped_writer(load)
        if writer is not None:
            message += (f"; it is the output of `megazoo train {writer}`: run that here first, or run this from the "
                        "folder you ran it in")
    example = load if os.path.isabs(load) else os.path.join("/path/to", load)
    return RecipeError(f"{message}. Point at the checkpoint with --set checkpoint.load={example} (a step_N "
                       "checkpoint directory or a run's checkpoints folder)")


def checkpoint_step_dir(path: str | Path) -> Path:
    """The step directory `checkpoint.load` names: the path itself when it holds a manifest, else (a run's
    checkpoints folder) the one its `latest` pointer names, else its newest step_* directory."""
    path = Path(path)
    if not path.exists():
        raise missing_load(str(path))
    if (path / _MANIFEST).is_file():
        return path
    candidates = sorted((p for p in path.glob("step_*") if (p / _COMMON).is_file()), reverse=True)
    try:
        named = path / (path / _LATEST).read_text(encoding="utf-8").strip()
        if (named / _COMMON).is_file():
            candidates.insert(0, named)
    except (OSError, UnicodeDecodeError):
        pass
    if not candidates:
        raise RecipeError(f"checkpoint.load = {str(path)!r} holds no checkpoint (no manifest.json, no step_* "
                          "directory with a common.json): give a step_N checkpoint directory or a run's "
                          "checkpoints folder")
    return candidates[0]


def checkpoint_model(path: str | Path) -> tuple[Path, dict]:
    """(step directory, the model config fields its common.json records)."""
    step = checkpoint_step_dir(path)
    try:
        model = json.loads((step / _COMMON).read_text(encoding="utf-8")).get("model")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as err:
        raise RecipeError(f"checkpoint.load: {step / _COMMON} is unreadable or corrupt: {err}") from None
    if not isinstance(model, dict):
        raise RecipeError(f"checkpoint.load: {step / _COMMON} records no model config")
    return step, model


def from_checkpoint(saved: dict, overrides: dict, step: Path) -> ModelConfig:
    """`model.from_checkpoint = true`: the checkpoint's model, with the recipe's non-architecture overrides
    (dropout, init, ...) applied; an architecture override that disagrees with the checkpoint is an error."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    clashes = [f"model.{k} = {v} here, {saved.get(k)} in the checkpoint" for k, v in overrides.items()
               if k in ARCHITECTURE_FIELDS and saved.get(k) != v]
    if clashes:
        raise RecipeError(f"model.from_checkpoint = true takes the architecture from {step}, but the recipe sets "
                          f"{'; '.join(clashes)}: remove these keys")
    try:
        cfg = ModelConfig(**{k: v for k, v in saved.items() if k in known})
        return cfg.replace(**{k: v for k, v in overrides.items() if k not in ARCHITECTURE_FIELDS})
    except (TypeError, ValueError) as err:
        raise RecipeError(f"checkpoint.load: the model recorded in {step / _COMMON} is invalid: {err}") from None


def check_against_checkpoint(cfg: ModelConfig, load: str) -> None:
    """Every architecture field in which the recipe's model differs from checkpoint.load's, in one message. A DCP
    folder no megazoo run wrote (torchtitan's) records no model: its tensors' shapes are checked when loading."""
    if (Path(load) / ".metadata").is_file() and not (Path(load) / _MANIFEST).is_file():
        return
    step, saved = checkpoint_model(load)
    mismatches = architecture_mismatches(saved, dataclasses.asdict(cfg))
    if mismatches:
        raise RecipeError(
            f"checkpoint.load = {load!r} ({step}) holds a different model than the recipe's {cfg.name}: "
            f"{'; '.join(mismatches)} (\"there\" = the checkpoint). Set model.from_checkpoint = true to take the "
            "architecture from the checkpoint, or change the recipe's [model] to match")
