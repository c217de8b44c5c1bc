"""Writing and reading sharded checkpoints: one file per rank, a manifest, atomic publication.

Layout of `root/step_00000100/`:
  manifest.json    format, step, the saving layout, every file's size and sha256, and an index of every piece:
                   (file, key, global name, kind, global shape, dtype, tp layout, flat range of the tp-local tensor)
  rank00000.pt     this rank's pieces (only what it owns; replicas are written once) + its own extras (RNG)
  common.pt        rank 0: scalars shared by all ranks (step, loss scaler, recipe)
A checkpoint is written to `.tmp-step_N`, verified, renamed to `step_N` and only then named in `latest`, so a
crash mid-save leaves the previous checkpoint the latest good one. Older checkpoints beyond `keep` are deleted
after a new one is published.

Why not torch.distributed.checkpoint: DCP reshards DTensor/ShardedTensor placements; ZeRO's flat buckets cut
parameters at arbitrary element offsets (not expressible as DTensor placements of the parameters), and the
tensor-parallel QKV layout is strided by sections. Pieces addressed by (name, tp layout, flat range) express
both and load into any layout with a few lines of assembly (load.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megazoo.data.fileio import atomic_write_bytes
from megazoo.data.fileio import file_sha256 as sha256_file
from megazoo.parallel.checkpoint.views import StateView

FORMAT = "megazoo-sharded-checkpoint/1"
LATEST = "latest"


class CheckpointError(ValueError):
    """A missing, truncated or corrupt checkpoint; the message names the path."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(root: str | Path, step: int, views: list[StateView], *, extras: dict, common: dict,
                    layout: dict, keep: int) -> Path:
    """Every rank calls this with its views; returns the published directory. Collective (barriers)."""
    rank, world = _world()
    root = Path(root)
    tmp = root / f".tmp-step_{step:08d}"
    if rank == 0:
        if tmp.exists():  # debris of an interrupted save of the same step
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    pieces, index = {}, []
    for i, view in enumerate(v for v in views if v.write):
        key = str(i)
        pieces[key] = view.tensor.detach().to("cpu", copy=True)
        index.append({"key": key, "name": view.name, "kind": view.kind, "start": view.start, "stop": view.stop,
                      "global_shape": list(view.spec.global_shape), "tp_dim": view.spec.dim,
                      "tp_sections": view.spec.sections, "tp_rank": view.spec.rank, "tp_size": view.spec.size,
                      "dtype": str(view.tensor.dtype).removeprefix("torch.")})
    filename = f"rank{rank:05d}.pt"
    torch.save({"pieces": pieces, "extras": extras}, tmp / filename)
    files = {filename: {"bytes": (tmp / filename).stat().st_size, "sha256": sha256_file(tmp / filename)}}
    if rank == 0:
        torch.save(common, tmp / "common.pt")
        files["common.pt"] = {"bytes": (tmp / "common.pt").stat().st_size, "sha256": sha256_file(tmp / "common.pt")}
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, (filename, files, index))
    else:
        gathered = [(filename, files, index)]
    final = step_dir(root, step)
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "layout": layout, "world_size": world, "files": {},
                    "pieces": []}
        for filename, rank_files, rank_index in gathered:
            manifest["files"].update(rank_files)
            manifest["pieces"] += [dict(entry, file=filename) for entry in rank_index]
        atomic_write_bytes(tmp / "manifest.json", json.dumps(manifest).encode())
        verify_checkpoint(tmp)  # every file there and intact before it is published
        if final.exists():  # the same step saved again: replace it only now that the new one is complete
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_bytes(root / LATEST, final.name.encode())
        _prune(root, keep, protect=final)
    _barrier()
    return final


def _prune(root: Path, keep: int, protect: Path) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        if old != protect:
            shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: str | Path) -> dict:
    """The manifest, after checking that every file it lists exists with its recorded size and sha256."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no manifest.json (incomplete or not a megazoo checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is corrupt: {err}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    for filename, info in manifest["files"].items():
        file = path / filename
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is truncated or changed: {size} bytes, "
                                  f"expected {info['bytes']}")
        if sha256_file(file) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {file} is corrupt: its sha256 does not match the manifest")
    return manifest


def latest_good_checkpoint(root: str | Path, report=print) -> Path | None:
    """The newest checkpoint under `root` that verifies, trying `latest` first, then older ones; every corrupt
    one is reported (by file) and skipped. None when there is none."""
    root = Path(root)
    candidates = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
            return candidate
        except CheckpointError as err:
            report(f"megazoo: skipping checkpoint: {err}")
    return None
