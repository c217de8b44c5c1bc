"""Writing and reading sharded checkpoints: one file per rank, a manifest, atomic publication.

Layout of `root/step_00000100/`:
  manifest.json    format, step, the saving layout, every file's size and sha256, and an index of every piece:
                   (file, key, global name, kind, global shape, dtype, tp layout, flat range of the tp-local tensor)
  manifest.sha256  the manifest's own sha256 (`sha256sum` format), written after it: an edited manifest is caught
  rank00000.pt     this rank's pieces (only what it owns; replicas are written once) + its own extras (RNG):
                   tensors and plain containers only, read with torch.load(weights_only=True)
  common.json      rank 0: plain data shared by all ranks (step, loss scaler, recipe, model config), as JSON
Nothing in a checkpoint is unpickled with code execution: an older checkpoint with a pickled common.pt is refused.

Saving (collective): rank 0 creates `.tmp-step_N`; every rank checks it sees that directory (a multi-node run
needs a shared filesystem), writes, fsyncs and hashes only its own file; rank 0 checks it sees every rank's file
at its size, assembles the manifest, renames the directory to `step_N` and only then names it in `latest`, so a
crash mid-save leaves the previous checkpoint the latest good one. Any rank's failure (disk full, unshared
directory) is gathered, so every rank raises the same CheckpointSaveError, and the temporary directory is removed.
Older checkpoints beyond `keep` are deleted after a new one is published.

Why not torch.distributed.checkpoint: DCP reshards DTensor/ShardedTensor placements; ZeRO's flat buckets cut
parameters at arbitrary element offsets (not expressible as DTensor placements of the parameters), and the
tensor-parallel QKV layout is strided by sections. Pieces addressed by (name, tp layout, flat range) express
both and load into any layout with a few lines of assembly (load.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from megazoo.data.fileio import atomic_write_bytes
from megazoo.data.fileio import file_sha256 as sha256_file
from megazoo.parallel.checkpoint.readback import HashingWriter, drop_cached_pages, read_back_problem
from megazoo.parallel.checkpoint.views import StateView
from megazoo.parallel.checkpoint.write_errors import describe_write_error as _describe_write_error

# Checkpoints of older megazoo versions (same format string, a pickled common.pt and no manifest.sha256) are
# recognised by those files and refused. (Bumping FORMAT to /2 is planned: tests/models/test_hf_interop.py pins /1.)
FORMAT = "megazoo-sharded-checkpoint/1"
LATEST = "latest"
MANIFEST, MANIFEST_SHA, COMMON = "manifest.json", "manifest.sha256", "common.json"
STEP_NAME = re.compile(r"step_\d{8,}")
FILE_NAME = re.compile(r"rank\d{5}\.pt|common\.json|__\d+_\d+\.distcp|\.metadata")  # the last two: format "dcp"
SHARED_FS_HINT = "multi-node runs need a shared filesystem for run.dir"


class CheckpointError(ValueError):
    """A missing, truncated or corrupt checkpoint; the message names the path."""


class CheckpointSaveError(CheckpointError):
    """Saving failed on some rank (disk full, unshared directory, ...): the temporary directory is removed, the
    previous checkpoint is intact, and the run must stop rather than run into the same failure again."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _from_rank0(value):
    """Rank 0's `value` on every rank (a barrier as well)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class CheckpointReadBackError(CheckpointSaveError):
    """A file written for a checkpoint does not read back as the bytes meant (parallel/checkpoint/readback.py)."""


def _write_file(path: Path, write, needed: int, verify: bool = True) -> dict:
    """Write with `write(f)` through a HashingWriter (the sha256 of the bytes meant), flush and fsync (on disk
    before publication); with `verify`, re-read the file from the storage and compare. Returns size and sha256."""
    try:
        with open(path, "wb") as f:
            writer = HashingWriter(f)
            write(writer)
            f.flush()
            os.fsync(f.fileno())
            if verify:
                drop_cached_pages(f.fileno())
    except (OSError, RuntimeError) as err:
        raise CheckpointSaveError(_describe_write_error(err, path, needed)) from err
    if verify and (problem := read_back_problem(path, writer.hexdigest(), writer.bytes)):
        raise CheckpointReadBackError(problem)
    return {"bytes": writer.bytes, "sha256": writer.hexdigest()}


def snapshot_views(views: list[StateView], host_copy=None) -> tuple[dict, list[dict]]:
    """The pieces this rank writes, copied to host memory, and their index entries. `host_copy(t)` makes the
    copy (async_save.py: into pinned memory on CUDA); default a plain copy to the CPU."""
    pieces, index = {}, []
    for i, view in enumerate(v for v in views if v.write):
        key = str(i)
        tensor = view.tensor.detach()
        pieces[key] = host_copy(tensor) if host_copy is not None else tensor.to("cpu", copy=True)
        index.append({
            "key": key, "name": view.name, "kind": view.kind, "start": view.start, "stop": view.stop,
            "global_shape": list(view.spec.global_shape), "tp_dim": view.spec.dim,
            "tp_sections": view.spec.sections, "tp_rank": view.spec.rank, "tp_size": view.spec.size,
            "dtype": str(view.tensor.dtype).removeprefix("torch.")})
    return pieces, index


def _write_rank(tmp: Path, rank: int, views: list[StateView] | tuple[dict, list[dict]], extras: dict,
                common: dict | None, verify: bool) -> dict:
    """This rank's part of a save: its file (and rank 0's common.json), hashed here. Errors become a message.
    `views` may be a snapshot_views result already (the background writer of async_save.py)."""
    host = socket.gethostname()
    status = {"rank": rank, "host": host, "files": {}, "index": [], "error": None, "read_back": None}
    if not tmp.is_dir():
        status["error"] = (f"checkpoint directory {tmp} is not shared between ranks (rank {rank} on host {host} "
                           f"does not see it): {SHARED_FS_HINT}")
        return status
    try:
        pieces, status["index"] = views if isinstance(views, tuple) else snapshot_views(views)
        needed = sum(p.numel() * p.element_size() for p in pieces.values()) + (1 << 16)
        filename = f"rank{rank:05d}.pt"
        status["files"][filename] = _write_file(tmp / filename, lambda f: torch.save(
            {"pieces": pieces, "extras": extras}, f), needed, verify)
        if common is not None:
            data = json.dumps(common, indent=1, sort_keys=True).encode()
            status["files"][COMMON] = _write_file(tmp / COMMON, lambda f: f.write(data), len(data), verify)
    except CheckpointReadBackError as err:
        status["error"] = status["read_back"] = f"rank {rank} on host {host}: {err}"
    except CheckpointSaveError as err:
        status["error"] = f"rank {rank} on host {host}: {err}"
    except Exception as err:  # noqa: BLE001 - reported by every rank instead of leaving the others waiting
        status["error"] = f"rank {rank} on host {host}: {type(err).__name__}: {err}"
    return status


def _publish(root: Path, tmp: Path, step: int, gathered: list[dict], layout: dict, keep: int, **fields) -> Path:
    """Rank 0: check every rank's file is here, write the manifest (+ its sha256), rename, point `latest`."""
    manifest = {"format": FORMAT, "step": step, "layout": layout, "world_size": len(gathered), "files": {},
                "pieces": [], **fields}  # fields: {"storage": "dcp"} for checkpoint.format = "dcp" (dcp_views.py)
    for status in gathered:
        for filename, info in status["files"].items():
            file = tmp / filename
            if not file.is_file() or file.stat().st_size != info["bytes"]:
                raise CheckpointSaveError(
                    f"checkpoint directory {tmp} is not shared between ranks (rank {status['rank']} on host "
                    f"{status['host']} wrote {filename}, which rank 0 on host {socket.gethostname()} does not "
                    f"see{'' if not file.is_file() else ' whole'}): {SHARED_FS_HINT}")
            manifest["files"][filename] = info
        manifest["pieces"] += [dict(entry, file=f"rank{status['rank']:05d}.pt") for entry in status["index"]]
    data = json.dumps(manifest).encode()
    try:
        atomic_write_bytes(tmp / MANIFEST, data)
        # the hash of the bytes meant; read_manifest below re-reads the file against it
        atomic_write_bytes(tmp / MANIFEST_SHA, f"{hashlib.sha256(data).hexdigest()}  {MANIFEST}\n".encode())
    except OSError as err:
        raise CheckpointSaveError(_describe_write_error(err, tmp / MANIFEST, len(data))) from err
    read_manifest(tmp)  # the manifest reads back (each rank re-read its own files; nothing is re-hashed here)
    final = step_dir(root, step)
    if final.exists():  # the same step saved again: replace it only now that the new one is complete
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_bytes(root / LATEST, final.name.encode())
    _prune(root, keep, protect=final)
    return final


def save_checkpoint(root: str | Path, step: int, views: list[StateView], *, extras: dict, common: dict,
                    layout: dict, keep: int, verify: bool = True, phase=None) -> Path:
    """Every rank calls this with its views; returns the published directory. Collective. Raises
    CheckpointSaveError on every rank when any rank fails; the previous checkpoint stays the latest. With
    `verify` every rank re-reads its files before publication (readback.py): one that does not read back as
    written raises CheckpointReadBackError naming it, and the new checkpoint is kept aside as bad-step_N.
    `phase(what)`, when given, is told as this rank enters each part (so a rank stuck writing is told from one
    waiting in the gather: recipes/training/progress.py)."""
    rank, _ = _world()
    tell = phase or (lambda what: None)
    tmp = prepare_save_dir(root, step)
    tell("writing this rank's files")
    status = _write_rank(tmp, rank, views, extras, common if rank == 0 else None, verify)
    tell("gathering every rank's status (all_gather)")
    return finish_save(root, tmp, step, status,
                       lambda gathered: _publish(Path(root), tmp, step, gathered, layout, keep))


def prepare_save_dir(root: str | Path, step: int) -> Path:
    """Collective: rank 0 creates root/.tmp-step_N (removing debris of an interrupted save of that step);
    every rank gets it, or the same CheckpointSaveError."""
    tmp = Path(root) / f".tmp-step_{step:08d}"
    error = None
    if _world()[0] == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        except OSError as err:
            error = _describe_write_error(err, tmp, 0)
    error = _from_rank0(error)
    if error:
        raise CheckpointSaveError(error)
    return tmp


def finish_save(root: str | Path, tmp: Path, step: int, status: dict, publish) -> Path:
    """Collective, after every rank wrote (status: _write_rank's): gather the statuses; rank 0 calls
    `publish(gathered)` (-> the published directory) when no rank failed; every rank raises the same error."""
    rank, world = _world()
    root = Path(root)
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, status)
    else:
        gathered = [status]
    errors = [s["error"] for s in gathered if s["error"]]
    final = None
    if rank == 0 and not errors:
        try:
            final = publish(gathered)
        except (CheckpointError, OSError) as err:
            errors.append(str(err))
    errors = _from_rank0(errors)  # rank 0's list (it may hold a publication error) on every rank
    if errors:
        read_back = [s["read_back"] for s in gathered if s["read_back"]] if rank == 0 else None
        read_back = _from_rank0(read_back)
        if rank == 0:
            if read_back:
                _mark_bad(root, tmp, step, read_back)
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        if read_back:  # one line: the file, and that nothing older was touched
            raise CheckpointReadBackError(
                f"{'; '.join(read_back)}: checkpoint step {step} is marked bad ({root / bad_name(step)}), the "
                "previous checkpoints are kept; stopping the run")
        raise CheckpointSaveError(f"saving checkpoint step {step} under {root} failed: {'; '.join(errors)}. The "
                                  "temporary directory was removed and the previous checkpoint is intact; "
                                  "stopping the run (fix the cause, then continue with --resume)")
    return step_dir(root, step) if final is None else final


def bad_name(step: int) -> str:
    """Where a checkpoint that did not read back is kept (outside step_*: never loaded, resumed or rotated)."""
    return f"bad-step_{step:08d}"


def _mark_bad(root: Path, tmp: Path, step: int, reasons: list[str]) -> None:
    """Rank 0: keep the unpublished checkpoint as evidence, with a BAD file saying why."""
    bad = root / bad_name(step)
    try:
        if bad.exists():
            shutil.rmtree(bad)
        (tmp / "BAD").write_text("\n".join(reasons) + "\n")
        os.replace(tmp, bad)
    except OSError:
        pass  # the error raised names the file either way; the temporary directory is removed by the caller


def _prune(root: Path, keep: int, protect: Path) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        if old != protect:
            shutil.rmtree(old, ignore_errors=True)


def _refuse_old(path: Path) -> None:
    if (path / "common.pt").exists():
        raise CheckpointError(f"checkpoint {path} was written by an older megazoo (with a pickled "
                              f"{path / 'common.pt'}): it is not loaded, because unpickling a file can run code. "
                              "Re-create it with this megazoo version (e.g. from its weights via megazoo convert)")


def read_manifest(path: str | Path) -> dict:
    """The manifest after checking it against manifest.sha256 and its structure (no data file is read)."""
    path = Path(path)
    manifest_path, sha_path = path / MANIFEST, path / MANIFEST_SHA
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (incomplete or not a megazoo checkpoint)")
    if not sha_path.is_file():
        _refuse_old(path)
        raise CheckpointError(f"checkpoint {path} has no {sha_path.name} (incomplete, or its manifest was not "
                              f"written by megazoo): {manifest_path} cannot be trusted")
    recorded = sha_path.read_bytes().split(b" ")[0].strip()
    if not re.fullmatch(rb"[0-9a-f]{64}", recorded):
        raise CheckpointError(f"checkpoint file {sha_path} is corrupt: it holds no sha256")
    if sha256_file(manifest_path) != recorded.decode():
        raise CheckpointError(f"checkpoint manifest {manifest_path} is corrupt or was changed: its sha256 does not "
                              f"match {sha_path}")
    try:
        manifest = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is corrupt: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        _refuse_old(path)
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{manifest_path}: format {found!r} is not {FORMAT!r}")
    try:
        for filename, info in manifest["files"].items():
            if not FILE_NAME.fullmatch(filename) or not isinstance(info["bytes"], int):
                raise ValueError(f"bad file entry {filename!r}")
            str(info["sha256"])
        for entry in manifest["pieces"]:
            if entry["file"] not in manifest["files"]:
                raise ValueError(f"piece {entry['name']} names unlisted file {entry['file']!r}")
        manifest["step"], manifest["layout"], manifest["world_size"]
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is malformed: {err!r}") from None
    return manifest


def verify_checkpoint(path: str | Path) -> dict:
    """The manifest, after checking it and that every file it lists exists with its recorded size and sha256."""
    path = Path(path)
    manifest = read_manifest(path)
    for filename, info in manifest["files"].items():
        file = path / filename
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is truncated or changed: {size} bytes, "
                                  f"expected {info['bytes']} ({path / MANIFEST})")
        if sha256_file(file) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {file} is corrupt: its sha256 does not match the manifest")
    return manifest


def read_common(path: str | Path) -> dict:
    """common.json of a checkpoint (plain data: step, optimizer_steps, scaler, recipe, model, global_batch)."""
    path = Path(path)
    file = path / COMMON
    if not file.is_file():
        _refuse_old(path)
        raise CheckpointError(f"checkpoint {path} has no {COMMON}")
    try:
        common = json.loads(file.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint file {file} is corrupt: {err}") from None
    if not isinstance(common, dict) or not isinstance(common.get("step"), int) or not isinstance(
            common.get("model"), dict):
        raise CheckpointError(f"checkpoint file {file} is corrupt: no integer step and model config")
    return common


def load_tensor_file(file: str | Path) -> dict:
    """A rank file's contents: tensors and plain containers only (weights_only=True); never runs code."""
    file = Path(file)
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"refusing to load checkpoint file {file}: it holds objects other than tensors and "
                              f"plain data, and unpickling them could run code ({reason})") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {err}") from None


def latest_good_checkpoint(root: str | Path, report=print, problems: list[str] | None = None) -> Path | None:
    """The newest checkpoint under `root` that verifies, trying `latest` first, then older ones; every corrupt
    one (and a corrupt `latest` pointer) is reported and, when `problems` is given, appended there with the
    reason. None when there is none."""
    root = Path(root)
    problems = [] if problems is None else problems
    candidates = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    latest = root / LATEST
    if latest.exists():
        try:
            name = latest.read_bytes().decode("utf-8").strip()
            if not STEP_NAME.fullmatch(name):
                raise ValueError(f"it names {name[:80]!r}, not a step_NNNNNNNN directory")
            candidates = [root / name] + [c for c in candidates if c != root / name]
        except (OSError, UnicodeDecodeError, ValueError) as err:
            problems.append(f"pointer {latest} is unreadable or corrupt: {err}")
            report(f"megazoo: ignoring {problems[-1]}; trying the checkpoints themselves")
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
            return candidate
        except CheckpointError as err:
            problems.append(f"{candidate}: {err}")
            report(f"megazoo: skipping checkpoint: {err}")
    return None
