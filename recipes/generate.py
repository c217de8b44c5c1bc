"""Sampling text from a (tensor-parallel) GPT: every rank runs the same loop and picks the same tokens.

The vocabulary-sharded logits of the last position are all-gathered over tp (small: one row), and the draw
uses a generator seeded identically on every rank, so all tp ranks extend the sequence with the same token.
"""

from __future__ import annotations

import torch

from megazoo.models.transformer import GPT
from megazoo.parallel.tensor import gather_from_tp_region


@torch.no_grad()
def generate(model: GPT, prompt: list[int], new_tokens: int, *, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0) -> list[int]:
    """Return prompt + new_tokens sampled ids (greedy when temperature is 0)."""
    was_training = model.training
    model.eval()
    draw = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=model.topo.device)
    for _ in range(new_tokens):
        window = ids[:, -model.cfg.n_positions:]
        local = model(window)[:, -1, :]  # (1, V/tp)
        logits = gather_from_tp_region(local, model.topo.tp_group)[:, :model.cfg.vocab_size].float().cpu()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=draw)
        ids = torch.cat([ids, nxt.to(ids.device)], dim=1)
    model.train(was_training)
    return ids[0].tolist()
