"""Whole-model views of sharded checkpoints, without processes: consolidation and single-file writing.

`read_full_state` assembles every parameter (fp32 masters when saved, else the parameters) from a checkpoint of
any layout, ZeRO-3 included, into full tensors: the input of Hugging Face export and evaluation.
`write_full_checkpoint` writes full tensors (e.g. imported from Hugging Face) as a one-rank sharded checkpoint,
which then loads into any layout like every other checkpoint.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from megazoo.parallel.checkpoint.io import (CheckpointError, latest_good_checkpoint, load_tensor_file, read_common,
                                            save_checkpoint, verify_checkpoint)
from megazoo.parallel.checkpoint.load import _assemble
from megazoo.parallel.checkpoint.views import StateView
from megazoo.parallel.tensor import ShardSpec


def resolve_checkpoint(path: str | Path, report=print, problems: list[str] | None = None) -> Path:
    """A step directory as given, or the latest good checkpoint of a checkpoints folder (each newer one that does
    not verify is reported and, when `problems` is given, appended there with the reason)."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    found = latest_good_checkpoint(path, report=report, problems=problems) if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"{path} is not a megazoo checkpoint (no manifest.json) and holds no good checkpoint")
    return found


def read_full_state(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(model config fields, {name: full fp32 tensor}) of a checkpoint; the embedding at the true vocabulary."""
    path = resolve_checkpoint(path)
    manifest = verify_checkpoint(path)
    model = read_common(path)["model"]
    by_name: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for entry in manifest["pieces"]:
        by_name[entry["name"]][entry["kind"]].append(entry)
    files = {f: load_tensor_file(path / f) for f in manifest["files"] if f.startswith("rank")}
    state = {}
    for name, kinds in by_name.items():
        entries = kinds.get("master") or kinds.get("param")
        if not entries:
            raise CheckpointError(f"checkpoint {path} holds no weights for {name}")
        state[name] = _assemble(entries, files, name, path).float()
    for name in ("wte.weight", "lm_head.weight"):  # rows of the padded vocabulary (models/layout.py)
        if name in state:
            state[name] = state[name][: model["vocab_size"]]
    return model, state


def write_full_checkpoint(full_state: dict[str, torch.Tensor], model: dict, out: str | Path,
                          tokenizer: dict | None = None) -> Path:
    """Write full tensors as a one-rank checkpoint under the checkpoints folder `out` (step 0, weights only);
    `tokenizer`: a tokenizer record (data/tokenizers/store.py) for common.json, so the checkpoint carries it."""
    views = [StateView(name, ShardSpec(tuple(t.shape)), "param", 0, t.numel(), t.detach().reshape(-1))
             for name, t in full_state.items()]
    layout = {"dp": 1, "tp": 1, "pp": 1, "virtual_stages": 1, "zero_stage": 0, "stage_layers": None}
    common = {"step": 0, "optimizer_steps": 0, "scaler": None, "recipe": None, "global_batch": None, "model": model}
    if tokenizer is not None:
        common["tokenizer"] = tokenizer
    return save_checkpoint(out, 0, views, extras={}, common=common, layout=layout, keep=1)
