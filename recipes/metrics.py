"""Run logging on rank 0: metrics.jsonl always, wandb when the recipe enables it (offline by default)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
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

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
