"""`[sft]`: supervised fine-tuning on a dataset written by `megazoo preprocess --format sft`.

    [sft]
    path = "data/chat"          # the dataset prefix (PREFIX.bin/.idx, PREFIX.lossmask.*, PREFIX.sft.json)
    valid_path = ""             # optional validation dataset, same layout
    packing = true              # several examples per train.seq_len row (false: one example per row, padded)

With a path, the training rows come from it instead of [data]: the loss counts response tokens only (targets are
-100 elsewhere, data/sft/packing.py) and packed examples neither see each other nor share positions
(models/packing.py). recipes/sft_check.py's `check_sft` runs in the resolver, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SFTSection:
    path: str = ""  # "" = not a fine-tuning run: [data] supplies the samples
    valid_path: str = ""
    packing: bool = True
