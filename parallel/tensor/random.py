"""Random streams for dropout under tensor parallelism.

Activations outside the tensor-parallel regions (embeddings, residual stream) are replicated on every tp rank:
their dropout masks must be identical there, so they draw from the default generator, seeded the same on all
tp ranks. Activations inside a region (attention probabilities of this rank's heads) are different data on
each rank: they draw from a second stream whose seed is offset by the tp rank, entered with `tracker.fork()`.

Activation checkpointing replays a block's forward; `replayable()` wraps a block so that the replay draws the
same tensor-parallel masks as the original forward and leaves the stream where the original run left it
(torch.utils.checkpoint already does this for the default generator).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from megazoo.parallel import accelerator

TP_SEED_OFFSET = 2718


_get_state, _set_state = accelerator.rng_state, accelerator.set_rng_state


class TPRNGTracker:
    """Holds the tensor-parallel stream's generator state; the default generator is the replicated stream."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        saved = _get_state(self.device)
        accelerator.manual_seed(seed + TP_SEED_OFFSET + tp_rank, self.device)
        self._state = _get_state(self.device)
        _set_state(saved, self.device)

    # No clone: a state tensor is never modified in place (torch.get_rng_state returns a new one and
    # set_rng_state copies), and under fake tensors (the dry run) a clone would have no data to restore.
    def get_state(self) -> torch.Tensor:
        return self._state

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state

    @contextlib.contextmanager
    def fork(self):
        """Draw from the tensor-parallel stream inside the block, then return to the default stream."""
        default = _get_state(self.device)
        _set_state(self._state, self.device)
        try:
            yield
        finally:
            self._state = _get_state(self.device)
            _set_state(default, self.device)

    def replayable(self, fn: Callable) -> Callable:
        """Wrap `fn` for torch.utils.checkpoint: every call after the first replays the first call's stream."""
        start = self.get_state()
        calls = 0

        def run(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 1:
                self.set_state(start)
                return fn(*args, **kwargs)
            after_forward = self.get_state()
            self.set_state(start)
            try:
                return fn(*args, **kwargs)
            finally:
                self.set_state(after_forward)

        return run


def seed_default_stream(seed: int, device: torch.device | str = "cpu") -> None:
    """Seed the replicated (default) stream: identical on every rank that passes the same seed."""
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        accelerator.manual_seed(seed, torch.device(device))
