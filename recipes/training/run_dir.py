"""A run's directory (run.dir) between jobs: one job at a time, and no run silently written over another.

- `RunDirLock.acquire(run_dir)`: an exclusive `fcntl.flock` on run.dir/.lock, which holds the holder's pid and
  host. `megazoo train` takes it before any process starts and holds it for the life of the launcher; its
  workers see `LOCK_HELD_ENV` and take nothing. A worker started by torchrun directly takes it on rank 0. The
  kernel releases it when the holder dies, however it dies (the file stays; only the lock matters).
- `previous_run(run_dir)`: what an earlier run left there (checkpoints, metrics.jsonl); `move_aside(run_dir)`
  moves all of it (never deletes) to a sibling folder run.dir.old-YYYYmmdd-HHMMSS (`--overwrite`).
- `write_resolved_recipe(run_dir, text, start_step)`: run.dir/recipe.resolved.toml, the recipe as this job runs
  it. A resumed job whose resolved recipe differs keeps the earlier one beside it, as
  recipe.resolved.before-step_N.toml (N: the step the new one takes over at): nothing a run wrote is lost.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from pathlib import Path

from megazoo.recipes.config import RecipeError

LOCK_NAME = ".lock"
STEP_DIR_NAME = re.compile(r"step_\d{8,}")  # parallel/checkpoint/io.py's STEP_NAME (that module loads torch)
RESOLVED_RECIPE = "recipe.resolved.toml"
LOCK_HELD_ENV = "MEGAZOO_RUN_LOCK_HELD"  # set by `megazoo train` for its workers: "the launcher holds the lock"


class RunDirBusy(RuntimeError):
    """Another job holds run.dir's lock."""


class RunDirLock:
    """An exclusive lock on a run directory, held while this object is open (a context manager)."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self.path, self._fd = run_dir, run_dir / LOCK_NAME, fd

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunDirLock:
        """Take the lock (creating run.dir), or raise RunDirBusy naming the holder's pid and host (RecipeError
        naming the folder when it cannot be created or written: a read-only file system, no permission)."""
        run_dir = Path(run_dir)
        path = run_dir / LOCK_NAME
        try:  # a folder this job cannot write is bad input: said before any process starts, not as a traceback
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (O_CLOEXEC)
        except OSError as err:
            where = err.filename or path
            raise RecipeError(f"run.dir = '{run_dir}' cannot be written ({err.strerror}: {where}): choose a "
                              f"folder this user can write, e.g. --set run.dir=runs/NAME") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise RunDirBusy(f"run.dir {run_dir} is in use by another job ({holder}; lock file {path}): wait for "
                             f"it to end, stop it, or choose another run.dir") from None
        except BaseException:
            os.close(fd)
            raise
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return cls(run_dir, fd)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor of the open file releases the flock
            self._fd = -1

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(data: bytes) -> str:
    try:
        holder = json.loads(data.decode())
        return f"pid {holder['pid']} on host {holder['host']}, since {holder.get('since', '?')}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown: it has not written its pid yet"


def previous_run(run_dir: str | Path) -> list[str]:
    """What an earlier run left in run_dir (empty when nothing): its checkpoints and its metrics."""
    run_dir, found = Path(run_dir), []
    checkpoints = run_dir / "checkpoints"
    steps = sorted(p.name for p in checkpoints.iterdir() if STEP_DIR_NAME.fullmatch(p.name) and p.is_dir()) \
        if checkpoints.is_dir() else []  # a plain file named step_* is no checkpoint (check_checkpoints says so)
    if steps:
        found.append(f"{len(steps)} checkpoint(s) up to {steps[-1]}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    for group in sorted(run_dir.glob("group-*")) if run_dir.is_dir() else []:  # fault-tolerant replica groups
        found += [f"{group.name}/{what}" for what in previous_run(group)]
    return found


def check_checkpoints(run_dir: str | Path) -> None:
    """Refuse, before any process starts, a plain file (or anything but a folder) named like a checkpoint's step
    folder under run.dir/checkpoints: resume would pass over it and the save of that step would fail after
    training up to it. Nothing is moved or deleted: it may be someone's file."""
    checkpoints = Path(run_dir) / "checkpoints"
    if not checkpoints.is_dir():
        return
    stray = sorted(p for p in checkpoints.iterdir() if STEP_DIR_NAME.fullmatch(p.name) and not p.is_dir())
    if stray:
        raise RecipeError(f"run.dir's checkpoints folder holds {len(stray)} entr{'y' if len(stray) == 1 else 'ies'} "
                          f"named like a checkpoint but not a folder ({', '.join(str(p) for p in stray[:3])}): "
                          "a checkpoint is a step_NNNNNNNN folder; move or remove "
                          f"{'it' if len(stray) == 1 else 'them'}, or choose another run.dir")


def move_aside(run_dir: str | Path) -> Path:
    """Move everything in run_dir but its lock to a new sibling run_dir.old-YYYYmmdd-HHMMSS[-N] (renames on
    the same filesystem: nothing is copied or deleted); returns that folder."""
    run_dir = Path(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}" + (f"-{n}" if n else ""))
        try:
            target.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise RuntimeError(f"cannot find a free name for the old contents of {run_dir}")
    for entry in run_dir.iterdir():
        if entry.name != LOCK_NAME:
            os.rename(entry, target / entry.name)
    return target


def write_resolved_recipe(run_dir: str | Path, text: str, start_step: int = 0) -> Path:
    """Write run_dir/recipe.resolved.toml (atomically); an earlier, different one moves to
    recipe.resolved.before-step_<start_step>.toml first (a numbered name if that exists too)."""
    from megazoo.data.fileio import atomic_write_text

    path = Path(run_dir) / RESOLVED_RECIPE
    if path.is_file():
        if path.read_text(encoding="utf-8") == text:
            return path
        for n in range(1000):
            keep = path.with_name(f"recipe.resolved.before-step_{start_step}" + (f".{n}" if n else "") + ".toml")
            if not keep.exists():
                os.rename(path, keep)
                break
    atomic_write_text(path, text)
    return path
