"""Megatron-LM's (and GPT-NeoX's) mmap indexed datasets, read directly: an existing corpus written by their
`tools/preprocess_data.py` trains without re-tokenizing. `IndexedDataset(prefix)` opens one of these when the
.idx starts with Megatron's magic, so recipes name such a prefix in data.paths like any other.

`.idx` layout (Megatron-LM megatron/core/datasets/indexed_dataset.py, `_IndexWriter`), little-endian, packed:

    offset  size          field
    0       9             magic b"MMIDIDX\\x00\\x00"
    9       8   uint64    version (1)
    17      1   uint8     token dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16; 6/7 are floats)
    18      8   uint64    sequence count S
    26      8   uint64    document count D (+1: it starts with 0)
    34      S * 4  int32  sequence lengths in tokens
    ...     S * 8  int64  sequence byte offsets (pointers) into .bin
    ...     D * 8  int64  document indices: the sequence index where each document starts, then S
    ...     S * 1  int8   sequence modes (multimodal datasets only)

Each *sequence* (one document of preprocess_data.py, with its end-of-document token when written with
--append-eod) becomes one document here. The format has no checksums: opening checks the sizes and that the
pointers describe the .bin exactly; `verify_data()` scans the tokens once for the largest id (cached in
PREFIX.bin.verified like megazoo's own format) and refuses negative ids.
"""

from __future__ import annotations

import struct

import numpy as np

from megazoo.data.fileio import file_sha256
from megazoo.data.indexed.dataset import _SCAN_BYTES, IndexedDataset, data_paths

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # 34 bytes, no padding
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


class MegatronIndexedDataset(IndexedDataset):
    """The same read-only view as IndexedDataset (lengths, offsets, tokens, doc(i), check_tokens) over a
    Megatron-LM PREFIX.bin/.idx pair."""

    def __init__(self, prefix) -> None:
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = data_paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"indexed dataset file not found: {path}")
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(MEGATRON_HEADER.size)
        if len(head) < MEGATRON_HEADER.size:
            raise ValueError(f"{self.idx_path} is truncated: {idx_size} bytes, shorter than Megatron's header")
        magic, version, code, count, doc_count = MEGATRON_HEADER.unpack(head)
        if magic != MEGATRON_MAGIC or version != 1:
            raise ValueError(f"{self.idx_path} is not a Megatron-LM index version 1 (magic {magic!r}, version "
                             f"{version})")
        if code not in MEGATRON_DTYPES:
            raise ValueError(f"{self.idx_path}: token dtype code {code} is not an integer type; valid: "
                             f"{', '.join(f'{c} ({np.dtype(d).name})' for c, d in MEGATRON_DTYPES.items())}")
        self.dtype = np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<")
        arrays = count * (4 + 8) + doc_count * 8
        if idx_size not in (MEGATRON_HEADER.size + arrays, MEGATRON_HEADER.size + arrays + count):
            raise ValueError(f"{self.idx_path} is truncated or corrupt: {idx_size} bytes, but its header ({count} "
                             f"sequences, {doc_count} document indices) needs {MEGATRON_HEADER.size + arrays}")
        start = MEGATRON_HEADER.size
        self.lengths = np.memmap(self.idx_path, dtype="<i4", mode="r", offset=start, shape=(count,)) \
            if count else np.zeros(0, np.int32)
        self.offsets = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=start + 4 * count, shape=(count,)) \
            if count else np.zeros(0, np.int64)
        bin_bytes = self.bin_path.stat().st_size
        item = self.dtype.itemsize
        if count:  # the pointers must tile the .bin exactly: a wrong dtype code or a truncated .bin shows here
            expected = np.zeros(count, np.int64)
            np.cumsum(np.asarray(self.lengths[:-1], np.int64) * item, out=expected[1:])
            if int(self.lengths.min()) < 0 or not np.array_equal(expected, self.offsets):
                raise ValueError(f"{self.idx_path} is corrupt: its sequence pointers do not follow its lengths")
            needed = int(self.offsets[-1]) + int(self.lengths[-1]) * item
            if bin_bytes != needed:
                raise ValueError(f"{self.bin_path} is {'truncated' if bin_bytes < needed else 'the wrong size'}: "
                                 f"{bin_bytes} bytes, but {self.idx_path.name} describes {needed}")
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if bin_bytes else np.zeros(0, self.dtype)
        self.num_tokens = bin_bytes // item
        self.checksum = file_sha256(self.idx_path)  # no stored checksum: the index's own hash names caches
        self._bin_sha = b""

    def _verification_key(self, stat) -> dict:
        return {"format": "megatron", "bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns,
                "index_sha256": self.checksum}

    def verify_data(self, *, cache: bool = True) -> int:
        """The largest token id (a scan of the .bin, cached by size and mtime); negative ids are an error."""
        if cache and (record := self._cached_verification()) is not None:
            return record["max_token"]
        before = self.bin_path.stat()
        max_token, step = -1, _SCAN_BYTES // self.dtype.itemsize
        for lo in range(0, self.num_tokens, step):
            block = np.asarray(self.tokens[lo:lo + step])
            if block.size and int(block.min()) < 0:
                raise ValueError(f"{self.bin_path} holds negative token id {int(block.min())} (token "
                                 f"{lo + int(np.argmin(block))}): not a token dataset, or the wrong dtype code")
            max_token = max(max_token, int(block.max()) if block.size else -1)
        if cache:
            self._cache_verification(before, max_token)
        return max_token

    def __repr__(self) -> str:
        return (f"MegatronIndexedDataset({self.prefix!r}, documents={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype})")
