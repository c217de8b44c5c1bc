"""Open a tokenized corpus in either indexed format it may be in: megazoo's own PREFIX.bin/.idx
(data/indexed/dataset.py) or Megatron-LM's / GPT-NeoX's (data/indexed/megatron.py), told apart by the index's magic.
This module sits above both, so neither format's module imports the other's reader back.
"""

from __future__ import annotations

from pathlib import Path

from megazoo.data.indexed.dataset import IndexedDataset, data_paths
from megazoo.data.indexed.megatron import MEGATRON_MAGIC, MegatronIndexedDataset


def open_indexed(prefix: str | Path) -> IndexedDataset:
    """The dataset at `prefix` (PREFIX.bin + PREFIX.idx), in whichever format its index is written in. Raises
    FileNotFoundError or ValueError naming the file when it is missing or damaged."""
    try:
        with open(data_paths(prefix)[1], "rb") as f:
            head = f.read(len(MEGATRON_MAGIC))
    except OSError:
        head = b""  # IndexedDataset names the missing file
    return MegatronIndexedDataset(prefix) if head == MEGATRON_MAGIC else IndexedDataset(prefix)


def check_indexed(prefix: str | Path, vocab_size: int | None = None, *, verify: bool = True) -> IndexedDataset:
    """The pre-start check of a dataset prefix (the recipe resolver calls it before any process starts): both
    files exist; the index's magic, version, sizes and checksum; the .bin's size and (with `verify`) its SHA-256,
    cached in PREFIX.bin.verified; and (with `vocab_size`) every token id < vocab_size. Raises FileNotFoundError
    or ValueError naming the file."""
    dataset = open_indexed(prefix)
    if verify:
        dataset.verify_data()
    if vocab_size is not None:
        dataset.check_tokens(vocab_size)
    return dataset
