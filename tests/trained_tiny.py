"""A tiny model trained by the real Trainer on the demo corpus (the stdlib source, a small slice) with its own
4,096-token BPE, saved as a training checkpoint: what `megazoo train` leaves in run.dir. Shared by the tests of
generation, export and evaluation (one run per test session)."""

from __future__ import annotations

import copy
from pathlib import Path

from recipe_helpers import TINY

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

VOCAB = 4096


def train_tiny(run_dir: Path, steps: int = 6) -> Path:
    """Train and save; returns the run's checkpoints/ folder."""
    table = copy.deepcopy(TINY)
    table["model"].update(vocab_size=VOCAB, n_positions=64)
    table["train"].update(steps=steps, precision="fp32", seq_len=32, eval_every=0)
    table["data"] = {"source": "stdlib", "vocab_size": VOCAB, "max_bytes": 300_000, "val_fraction": 0.05}
    table.update(run={"dir": str(run_dir)}, checkpoint={"at_end": True}, sample={"tokens": 0})
    res = resolve(from_dict(Recipe, table))
    Trainer(res, Topology.solo()).fit()
    return run_dir / "checkpoints"


_TRAINED: dict[str, Path] = {}


def trained_checkpoints(tmp_path_factory) -> Path:
    """The session's one trained run (its checkpoints/ folder), trained on first use."""
    if "run" not in _TRAINED:
        _TRAINED["run"] = train_tiny(tmp_path_factory.mktemp("trained-tiny") / "run")
    return _TRAINED["run"]
