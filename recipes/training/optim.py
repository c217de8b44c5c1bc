"""The learning-rate schedule: linear warmup, then cosine decay (AdamW itself lives in parallel/zero/)."""

from __future__ import annotations

import math

from megazoo.recipes.config import TrainSection


def lr_at(step: int, train: TrainSection, decay_steps: int) -> float:
    """Linear warmup over warmup_steps to lr, then cosine decay to min_lr at decay_steps, then min_lr."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if step >= decay_steps:
        return train.min_lr
    progress = (step - train.warmup_steps) / max(1, decay_steps - train.warmup_steps)
    return train.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (train.lr - train.min_lr)
