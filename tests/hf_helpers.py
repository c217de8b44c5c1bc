"""A random tiny Hugging Face GPT-2 (no download) for the interop, fine-tuning and reproduce tests."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 50257


def tiny_hf_model(seed: int = 0, vocab: int = VOCAB) -> GPT2LMHeadModel:
    """A random 2-layer GPT-2; a wide init (std 0.1) gives peaked logits, so mismatches would show."""
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=vocab, initializer_range=0.1)
    return GPT2LMHeadModel(cfg).eval()
