"""Whole-model views of sharded checkpoints, without processes: consolidation and single-file writing.

`read_full_state` assembles every parameter (fp32 masters when saved, else the parameters) from a checkpoint of
any layout, ZeRO-3 included, into full tensors: the input of Hugging Face export and evaluation.
`write_full_checkpoint` writes full tensors (e.g. imported from Hugging Face) as a one-rank sharded checkpoint,
which then loads into any layout like every other checkpoint.

The streaming pair, for models larger than a host's memory (models/hf/converter.py): `CheckpointReader` assembles
one full tensor at a time from whichever rank files hold its pieces (each mapped for that read only, so resident
memory grows by the tensor, not the files); `write_streamed_checkpoint` writes tensors as they arrive into rank
files of at most `file_bytes` each (a checkpoint written by N "ranks" of a dp = tp = pp = 1 layout: every file's
pieces are whole tensors, which load.py reshards into any layout like any other checkpoint).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from megazoo.parallel.checkpoint.io import (CheckpointError, CheckpointSaveError, _publish, _write_rank,
                                            latest_good_checkpoint, load_tensor_file, prepare_save_dir, read_common,
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
    if manifest.get("storage") == "dcp":
        reader = CheckpointReader(path)
        return model, {name: reader.read(name).float() for name in reader.names()}
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


VOCAB_ROWS = ("wte.weight", "lm_head.weight")  # stored at the padded vocabulary (models/layout.py)


class CheckpointReader:
    """One full tensor at a time from a checkpoint of any layout (after verifying every file's sha256)."""

    def __init__(self, path: str | Path):
        self.path = resolve_checkpoint(path)
        self.manifest = verify_checkpoint(self.path)
        self.common = read_common(self.path)
        self.model = self.common["model"]
        self._pieces: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for entry in self.manifest["pieces"]:
            self._pieces[entry["name"]][entry["kind"]].append(entry)
        self._dcp = None
        if self.manifest.get("storage") == "dcp":  # checkpoint.format = "dcp": keys "<kind>/<name>" (dcp_views.py)
            from megazoo.parallel.checkpoint.dcp import DCPReader

            self._dcp = DCPReader(self.path)
            for key in self._dcp.names():
                kind, name = key.split("/", 1)
                self._pieces[name][kind].append({"dtype": self._dcp.dtype(key).removeprefix("torch."), "key": key})

    def names(self) -> list[str]:
        return list(self._pieces)

    def param_dtype(self) -> torch.dtype:
        """The dtype the model's parameters were saved in (what it computes in; masters may be fp32)."""
        dtypes = {e["dtype"] for kinds in self._pieces.values() for e in kinds.get("param", [])}
        if not dtypes:  # only masters saved
            dtypes = {e["dtype"] for kinds in self._pieces.values() for e in kinds.get("master", [])}
        return getattr(torch, "float32" if len(dtypes) != 1 else dtypes.pop())

    def dtype(self, name: str) -> torch.dtype:
        """The dtype read(name) returns (the fp32 masters' when saved, else the parameter's)."""
        kinds = self._pieces.get(name) or {}
        entries = kinds.get("master") or kinds.get("param")
        if not entries:
            raise CheckpointError(f"checkpoint {self.path} holds no weights for {name}")
        return getattr(torch, entries[0]["dtype"])

    def read(self, name: str) -> torch.Tensor:
        """The full tensor `name` (fp32 masters when saved, else the parameters in their dtype), at the true
        vocabulary; only the rank files holding its pieces are mapped, and only for this read."""
        kinds = self._pieces.get(name)
        entries = kinds and (kinds.get("master") or kinds.get("param"))
        if not entries:
            raise CheckpointError(f"checkpoint {self.path} holds no weights for {name}")
        if self._dcp is not None:  # stored at the true vocabulary already
            return self._dcp.read(entries[0]["key"])
        files = {f: load_tensor_file(self.path / f) for f in sorted({e["file"] for e in entries})}
        full = _assemble(entries, files, name, self.path)
        del files  # the mappings go, and the pages they brought in with them
        return full[: self.model["vocab_size"]].clone() if name in VOCAB_ROWS else full


def write_streamed_checkpoint(tensors, model: dict, out: str | Path, tokenizer: dict | None = None,
                              file_bytes: int = 1 << 30) -> Path:
    """Write (name, full tensor) pairs as they arrive as a step-0 checkpoint under `out` (weights only), cutting a
    new rank file whenever the next tensor would pass `file_bytes`; at most one file's tensors are held."""
    layout = {"dp": 1, "tp": 1, "pp": 1, "virtual_stages": 1, "zero_stage": 0, "stage_layers": None}
    common = {"step": 0, "optimizer_steps": 0, "scaler": None, "recipe": None, "global_batch": None, "model": model}
    if tokenizer is not None:
        common["tokenizer"] = tokenizer
    tmp = prepare_save_dir(out, 0)
    statuses: list[dict] = []
    group: list[StateView] = []

    def flush() -> None:
        status = _write_rank(tmp, len(statuses), group, {}, common if not statuses else None, verify=True)
        if status["error"]:
            raise CheckpointSaveError(f"writing checkpoint {out} failed: {status['error']}")
        statuses.append(status)
        group.clear()

    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > file_bytes:
            flush()
            size = 0
        group.append(StateView(name, ShardSpec(tuple(t.shape)), "param", 0, t.numel(), t.detach().reshape(-1)))
        size += nbytes
    flush()
    return _publish(Path(out), tmp, 0, statuses, layout, keep=1)
