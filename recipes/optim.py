"""AdamW with weight-decay groups, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from recipes.config import TrainSection


def build_adamw(model: torch.nn.Module, train: TrainSection) -> torch.optim.AdamW:
    """Decay matrices and embeddings; never biases or LayerNorm parameters (every 1-D tensor), as GPT-2."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps)


def lr_at(step: int, train: TrainSection, decay_steps: int) -> float:
    """Linear warmup over warmup_steps to lr, then cosine decay to min_lr at decay_steps, then min_lr."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if step >= decay_steps:
        return train.min_lr
    progress = (step - train.warmup_steps) / max(1, decay_steps - train.warmup_steps)
    return train.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (train.lr - train.min_lr)
