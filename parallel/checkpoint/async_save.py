"""Asynchronous checkpoint save: the saving step returns once the state is copied to host memory; a background
thread serialises, fsyncs, hashes, re-reads and publishes it with io.py's guarantees.

One save of step N, on every rank:

  save()     main thread. prepare_save_dir (collective: rank 0 creates .tmp-step_N, every rank agrees); the
             rank's pieces and extras copied to host memory (CUDA: pinned buffers via parallel/accelerator.py,
             non-blocking copies, one synchronize; CPU: clones), so training may change the live state at once;
             the writer thread starts. Returns the directory the checkpoint will be published as.
  writer     io._write_rank on the snapshot (torch.save, fsync, sha256, the verify-on-save re-read), then this
             rank's status as .tmp-step_N/.status-rankR.json (atomic write).
  publisher  rank 0 only: once every rank's status file is there and none failed, io._publish: manifest, rename
             to step_N, `latest`, keep-K pruning, in the sync save's order. A crash at any point before the
             rename leaves the previous checkpoint the latest good one; the debris .tmp-step_N is removed by the
             next save of that step, as today.
  wait()     collective, called by the next save, at the end of training and on a stop (SIGTERM): joins the
             threads and gathers the statuses (io.finish_save), so a failed write raises the same
             CheckpointSaveError / CheckpointReadBackError on every rank there, naming the step and the file.
  abandon()  on an exception: waits for this rank's own writer (no collective: the other ranks may be gone) and
             returns its error, if any, for the caller to report next to the exception.

Only one save is in flight: save() waits for the previous one first. No collective runs off the main thread:
writer and publisher meet through files in the checkpoint directory, which multi-node runs must share anyway.

Why a thread, not a process: the snapshot is already in this process's host memory, and torch.save's writes,
fsync and sha256 release the GIL; a process would need the snapshot copied again (or shared memory) and would be
one more child for the launcher to own.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from megazoo.data.fileio import atomic_write_bytes
from megazoo.parallel import accelerator
from megazoo.parallel.checkpoint import io
from megazoo.parallel.checkpoint.views import StateView

POLL_S = 0.01  # how often the publisher looks for the other ranks' status files


@dataclass
class _Save:
    root: Path
    tmp: Path
    step: int
    rank: int
    world: int
    layout: dict
    keep: int
    status: dict | None = None  # this rank's, once written
    published: Path | None = None  # rank 0: the publisher's result
    publish_error: BaseException | None = None
    gathered: list[dict] | None = None  # rank 0: every rank's status, handed over by wait()
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)


class AsyncCheckpointSaver:
    """One per training run. `before_write(step)` (tests) runs on the writer thread before it writes."""

    def __init__(self, device: torch.device, before_write: Callable[[int], None] | None = None):
        self.device = torch.device(device)
        self.before_write = before_write
        self._save: _Save | None = None

    def in_flight(self) -> bool:
        return self._save is not None

    def save(self, root: str | Path, step: int, views: list[StateView], *, extras: dict, common: dict,
             layout: dict, keep: int, verify: bool = True) -> Path:
        """Collective: wait for the previous save, snapshot to host memory, start the background write."""
        self.wait()
        rank, world = io._world()
        root = Path(root)
        tmp = io.prepare_save_dir(root, step)
        snapshot = io.snapshot_views(views, self._host_copy)
        extras = self._host_tree(extras)
        if self.device.type == "cuda":
            accelerator.synchronize(self.device)  # the non-blocking copies have landed
        save = _Save(root, tmp, step, rank, world, layout, keep)
        save.threads.append(threading.Thread(target=self._write, name=f"checkpoint-writer-{step}", daemon=True,
                                             args=(save, snapshot, extras, common if rank == 0 else None, verify)))
        if rank == 0:
            save.threads.append(threading.Thread(target=self._publish, args=(save,), daemon=True,
                                                 name=f"checkpoint-publisher-{step}"))
        for thread in save.threads:
            thread.start()
        self._save = save
        return io.step_dir(root, step)

    def wait(self) -> Path | None:
        """Collective: the save in flight finished and published, or its error raised on every rank."""
        save, self._save = self._save, None
        if save is None:
            return None
        save.threads[0].join()
        try:
            return io.finish_save(save.root, save.tmp, save.step, save.status,
                                  lambda gathered: self._published(save, gathered))
        finally:
            save.stop.set()
            for thread in save.threads[1:]:
                thread.join()

    def abandon(self) -> str | None:
        """After an exception, without collectives: wait for this rank's writer; its error message, if any."""
        save, self._save = self._save, None
        if save is None:
            return None
        save.threads[0].join()
        save.stop.set()  # rank 0 still publishes if every rank's status file says it wrote
        for thread in save.threads[1:]:
            thread.join()
        return save.status["error"] if save.status else f"checkpoint step {save.step}: the writer did not finish"

    # ---- background ----------------------------------------------------------------------------------------------
    def _write(self, save: _Save, snapshot, extras: dict, common: dict | None, verify: bool) -> None:
        try:
            if self.before_write is not None:
                self.before_write(save.step)
            status = io._write_rank(save.tmp, save.rank, snapshot, extras, common, verify)
        except BaseException as err:  # noqa: BLE001 - reported at wait() on every rank
            status = {"rank": save.rank, "host": "?", "files": {}, "index": [], "read_back": None,
                      "error": f"rank {save.rank}: {type(err).__name__}: {err}"}
        save.status = status
        try:
            atomic_write_bytes(self._status_file(save, save.rank), json.dumps(status).encode())
        except OSError:
            pass  # the publisher then waits for wait()'s gathered statuses, which say the same

    def _publish(self, save: _Save) -> None:
        files = [self._status_file(save, r) for r in range(save.world)]
        while True:
            if all(f.is_file() for f in files):
                try:
                    statuses = [json.loads(f.read_text()) for f in files]
                    break
                except (OSError, ValueError):  # a failed save's directory removed under us: wait for stop
                    pass
            if save.gathered is not None:
                statuses = save.gathered
                break
            if save.stop.is_set():
                return
            time.sleep(POLL_S)
        if any(s["error"] for s in statuses):
            return  # finish_save raises it on every rank
        try:
            for f in files:
                f.unlink(missing_ok=True)
            save.published = io._publish(save.root, save.tmp, save.step, statuses, save.layout, save.keep)
        except BaseException as err:  # noqa: BLE001 - raised by wait()
            save.publish_error = err

    def _published(self, save: _Save, gathered: list[dict]) -> Path:
        """Rank 0 in finish_save (no rank failed): the publisher's result."""
        save.gathered = gathered
        save.threads[1].join()
        if save.publish_error is not None:
            raise save.publish_error
        return save.published

    @staticmethod
    def _status_file(save: _Save, rank: int) -> Path:
        return save.tmp / f".status-rank{rank:05d}.json"

    # ---- host copies -----------------------------------------------------------------------------------------------
    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cuda":
            out = accelerator.pinned_empty(t.shape, t.dtype)
            out.copy_(t, non_blocking=True)
            return out
        return t.detach().clone()

    def _host_tree(self, value):
        """Extras (random states, 1-bit Adam's per-rank buffers) with every tensor copied: the live ones move on."""
        if isinstance(value, torch.Tensor):
            return self._host_copy(value)
        if isinstance(value, dict):
            return {k: self._host_tree(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._host_tree(v) for v in value)
        return value
