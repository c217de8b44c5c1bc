"""The trainer's closing sample: text from a (tensor-parallel) GPT, every rank running the same loop.

The loop itself (KV cache, tp-gathered logits, identically seeded draws) is models/generation/generate.py's `decode`,
shared with `megazoo generate` and the lm-eval adapter.
"""

from __future__ import annotations

from collections.abc import Callable

from megazoo.models.generation.generate import decode
from megazoo.models.transformer import GPT


def generate(model: GPT, prompt: list[int], new_tokens: int, *, temperature: float = 0.8, top_k: int = 40,
             top_p: float = 1.0, seed: int = 0, stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Return prompt + up to new_tokens sampled ids (greedy when temperature is 0); `stop(new_ids)` ends it early
    (a fine-tuned model's end-of-turn marker), else it never stops early."""
    return decode(model, prompt, new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  stop=stop)
