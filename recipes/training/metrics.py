"""Run logging on rank 0: metrics.jsonl always, wandb when the recipe enables it (offline by default).

metrics.jsonl is one clean history: every line is flushed and fsynced when written (so the lines of the steps a
checkpoint holds are on disk before the next checkpoint is), and a run that resumes at step S first drops the
lines of steps >= S (written after that checkpoint by the job that died), keeping them in
metrics.jsonl.discarded, with an atomic rewrite.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch

from megazoo.data.fileio import atomic_write_text
from megazoo.parallel import accelerator


def peak_memory_bytes(device: torch.device) -> int:
    """On GPU the peak memory the caching allocator reserved (what the device really had to hold, fragmentation
    included; the Trainer resets it every step); on CPU the peak resident set size of this process."""
    if device.type == "cuda":
        return accelerator.max_memory_reserved(device)
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024


class MetricsLog:
    """Appends one JSON object per optimizer step to run_dir/metrics.jsonl; mirrors it to wandb if enabled."""

    def __init__(self, run_dir: str | Path, *, enabled: bool, wandb_mode: str = "off", project: str = "megazoo",
                 config: dict | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if wandb_mode != "off":
            try:
                import wandb
            except ImportError:
                raise RuntimeError("logging.wandb is enabled but wandb is not installed: "
                                   "pip install 'megazoo[wandb]' or set logging.wandb = \"off\"") from None
            self._wandb = wandb.init(project=project, dir=str(self.path.parent), mode=wandb_mode, config=config)

    def start_at(self, step: int, report=print) -> None:
        """Training (re)starts at `step`: drop the lines of steps >= step (and any torn line), appending them to
        metrics.jsonl.discarded; the file is rewritten atomically, and only when something is dropped."""
        if not self.enabled or not self.path.is_file():
            return
        keep, drop = [], []
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                kept = line.endswith("\n") and json.loads(line)["step"] < step
            except (ValueError, KeyError, TypeError):
                kept = False
            (keep if kept else drop).append(line if line.endswith("\n") else line + "\n")
        if not drop:
            return
        discarded = self.path.with_name(self.path.name + ".discarded")
        with discarded.open("a") as f:
            f.writelines(drop)
            f.flush()
            os.fsync(f.fileno())
        atomic_write_text(self.path, "".join(keep))
        report(f"megazoo: {self.path.name}: starting at step {step}, moved {len(drop)} later line(s) to {discarded}")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
