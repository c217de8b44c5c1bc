"""What the ZeroEngine-on-any-model tests share: a tiny fp64 Hugging Face GPT-2, its next-token loss and the
fixed batches, with the training constants and the fp64 tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 6, 8, 32, 300
LR, WD, CLIP = 3e-3, 0.1, 0.5
TOL = 1e-10


def tiny_gpt2(device=None) -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return transformers.GPT2LMHeadModel(cfg).double()


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in the logits' dtype (HF's built-in loss upcasts to fp32 only, which would cap
    the parity tolerance at ~1e-7 instead of fp64's ~1e-15)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def batches() -> torch.Tensor:
    """(STEPS, BATCH, SEQ) counting sequences from random starts: learnable within a few steps."""
    starts = torch.randint(0, VOCAB, (STEPS, BATCH, 1), generator=torch.Generator().manual_seed(1))
    return (starts + torch.arange(SEQ)) % VOCAB
