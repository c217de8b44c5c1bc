"""An SFT dataset on disk: the examples' tokens, their loss masks and a manifest, written atomically.

    PREFIX.bin / PREFIX.idx                    token ids, one document per example (data/indexed/dataset.py)
    PREFIX.lossmask.bin / PREFIX.lossmask.idx  per-token loss mask, same lengths (1 = a response token)
    PREFIX.sft.json                            template, sequence length, counts, every bad row skipped

Both indexed files carry the indexed format's checksums, so a damaged mask is caught like damaged tokens; the
reader also checks that the two agree example by example. The manifest is written last: a prefix without it
is an unfinished write, and nothing opens it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megazoo.data.fileio import atomic_write_text
from megazoo.data.indexed.dataset import IndexedDataset, IndexedDatasetWriter, data_paths
from megazoo.data.sft.examples import SFTExamples

MASK_SUFFIX = ".lossmask"
MANIFEST_SUFFIX = ".sft.json"
FORMAT = "megazoo-sft-1"


def sft_paths(prefix: str | Path) -> list[Path]:
    """Every file an SFT dataset at `prefix` consists of."""
    return [*data_paths(prefix), *data_paths(str(prefix) + MASK_SUFFIX), Path(str(prefix) + MANIFEST_SUFFIX)]


def write_sft_dataset(examples: SFTExamples, prefix: str | Path, vocab_size: int, *, template: str, seq_len: int,
                      overwrite: bool = False) -> dict:
    """Write the examples (none of them bad) under `prefix`; returns the manifest."""
    existing = [str(p) for p in sft_paths(prefix) if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"output {' and '.join(existing)} already exists; pass --overwrite to replace it")
    if not examples.ids:
        raise ValueError(f"no usable examples among {examples.rows} rows: nothing written")
    lengths = np.array([len(ids) for ids in examples.ids], dtype=np.int64)
    Path(str(prefix) + MANIFEST_SUFFIX).unlink(missing_ok=True)  # overwrite: unreadable until the new one is whole
    with IndexedDatasetWriter(str(prefix) + MASK_SUFFIX, 2, overwrite=overwrite) as masks, \
            IndexedDatasetWriter(prefix, vocab_size, overwrite=overwrite) as tokens:
        tokens.add_documents(np.concatenate([np.asarray(i, np.int64) for i in examples.ids]), lengths)
        masks.add_documents(np.concatenate([np.asarray(m, np.int64) for m in examples.masks]), lengths)
    manifest = {
        "format": FORMAT, "template": template, "seq_len": seq_len, "vocab_size": vocab_size,
        "rows": examples.rows, "examples": len(examples.ids), "tokens": int(lengths.sum()),
        "response_tokens": int(sum(sum(m) for m in examples.masks)),
        "bad_rows": [{"where": bad.where, "reason": bad.reason} for bad in examples.bad],
    }
    atomic_write_text(Path(str(prefix) + MANIFEST_SUFFIX), json.dumps(manifest, indent=1) + "\n")
    return manifest


class SFTDataset:
    """Read-only: `len(ds)` examples, `ds.example(i)` -> (ids, mask) numpy arrays, `ds.lengths`, `ds.manifest`."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        manifest_path = Path(self.prefix + MANIFEST_SUFFIX)
        if not manifest_path.is_file():
            raise FileNotFoundError(f"SFT dataset manifest not found: {manifest_path} (write the dataset with "
                                    "`megazoo preprocess --format sft`)")
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_path} has format {self.manifest.get('format')!r}; this megazoo reads "
                             f"{FORMAT!r}")
        self.tokens = IndexedDataset(self.prefix)
        self.masks = IndexedDataset(self.prefix + MASK_SUFFIX)
        if len(self.tokens) != len(self.masks) or not np.array_equal(self.tokens.lengths, self.masks.lengths):
            raise ValueError(f"{self.prefix}: the loss mask's example lengths do not match the tokens' (one of the "
                             f"two files was replaced)")
        if len(self.tokens) != self.manifest["examples"]:
            raise ValueError(f"{manifest_path} records {self.manifest['examples']} examples, but {self.prefix}.idx "
                             f"holds {len(self.tokens)}")
        self.lengths = np.asarray(self.tokens.lengths, dtype=np.int64)
        self.seq_len = int(self.manifest["seq_len"])

    def __len__(self) -> int:
        return len(self.tokens)

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.tokens.doc(index), np.int64), np.asarray(self.masks.doc(index), np.int64)
