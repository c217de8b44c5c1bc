"""Synthetic fine-tuning rows for `megazoo verify` on a recipe with an `[sft]` section.

The recipe's own SFT data is not part of its layout (and is often not on the machine that verifies), but what an
`[sft]` section changes is: response-only targets (-100 on prompt tokens), examples packed several to a row with
their own positions and attention blocks (or one per padded row), and each micro-batch's loss weighted by its
share of the step's response tokens across dp ranks and accumulation steps (data/sft/packing.py). A layout that
splits a step's rows differently from one process must still weigh them the same. So verify writes a small SFT
dataset of random examples of uneven lengths and uneven response shares, in the shrunk vocabulary and sequence
length, with the same file format `megazoo preprocess --format sft` writes, and both runs read it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megazoo.data.sft.dataset import write_sft_dataset
from megazoo.data.sft.examples import SFTExamples

EXAMPLES = 256  # more rows than a few verify steps take at any packing
TEMPLATE = "synthetic (megazoo verify)"


def synthetic_examples(vocab_size: int, seq_len: int, seed: int, count: int = EXAMPLES) -> SFTExamples:
    """`count` examples of 4..seq_len tokens (ids in [0, vocab_size)), each a prompt (mask 0) followed by a
    response (mask 1) of at least one token; lengths and response shares vary, so rows and micro-batches hold
    different numbers of response tokens."""
    rng = np.random.default_rng(seed)
    out = SFTExamples(rows=count)
    for _ in range(count):
        length = int(rng.integers(4, max(5, seq_len // 2) + 1))
        prompt = int(rng.integers(1, length))  # at least one prompt token and one response token
        out.ids.append(rng.integers(0, vocab_size, size=length).tolist())
        out.masks.append([0] * prompt + [1] * (length - prompt))
    return out


def write_synthetic_sft(folder: Path, vocab_size: int, seq_len: int) -> tuple[str, str]:
    """(train prefix, validation prefix) of synthetic SFT datasets written under `folder`: a validation split
    always, so the validation loss over fine-tuning rows is compared too (whether the recipe has one or not)."""
    prefixes = []
    for split, seed in (("train", 0), ("valid", 1)):
        prefix = folder / f"synthetic_sft_{split}"
        write_sft_dataset(synthetic_examples(vocab_size, seq_len, seed), prefix, vocab_size, template=TEMPLATE,
                          seq_len=seq_len)
        prefixes.append(str(prefix))
    return prefixes[0], prefixes[1]
