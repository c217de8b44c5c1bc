"""Indexed token datasets on disk: `PREFIX.bin` (all token ids, documents back to back) + `PREFIX.idx`.

The layout follows Megatron-LM's mmap indexed dataset (one flat token file plus a small index of per-document
lengths and byte offsets, read through numpy memmap so opening a 100 GB corpus costs nothing) with two
additions: a SHA-256 over the whole index (which also records the .bin size and the .bin's own SHA-256), so a
flipped byte or a truncated file is reported with its path instead of silently training on garbage, and an
atomic writer (temporary names, renamed into place at the end) that never overwrites an existing prefix
unless asked.

`.idx` layout, little-endian:

    offset  size          field
    0       8             magic b"MZIDX\\x00\\x00\\x00"
    8       4   uint32    format version (1)
    12      1   uint8     token dtype code   (2 = uint16, 4 = uint32; see DTYPE_CODES)
    13      1   uint8     length dtype code  (3 = int32, 5 = int64)
    14      2             zero padding (keeps the arrays 8-byte aligned)
    16      8   uint64    document count N
    24      8   uint64    .bin size in bytes
    32      32            SHA-256 of the .bin contents (checked by `verify_data()`, not on open: it reads it all)
    64      N * 4|8       document lengths in tokens
    ...     N * 8  int64  document byte offsets into .bin
    end-32  32            SHA-256 of every byte above

Verifying the .bin (`verify_data()`, `check_indexed()`) hashes it once and records the result in
`PREFIX.bin.verified` (JSON: the .bin's size, mtime and SHA-256, the index checksum and the largest token id,
written atomically), so a 100 GB corpus is not re-hashed at every start: a later check only compares size and
mtime. A file modified within the last few seconds is not cached (its mtime could still change within the
timestamp's granularity). `check_indexed(prefix, vocab_size)` is the pre-start check the recipe resolver calls
before any process starts.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from array import array
from pathlib import Path

import numpy as np

from megazoo.data.fileio import AtomicFile, atomic_write_text, file_sha256

MAGIC = b"MZIDX\x00\x00\x00"
VERSION = 1
HEADER = struct.Struct("<8sIBB2xQQ32s")  # 64 bytes
DIGEST_BYTES = 32
DTYPE_CODES = {1: np.uint8, 2: np.uint16, 3: np.int32, 4: np.uint32, 5: np.int64}
VERIFIED_SUFFIX = ".verified"  # PREFIX.bin.verified: the cached result of hashing PREFIX.bin
_SCAN_BYTES = 1 << 24  # block size when hashing and scanning the .bin (a multiple of every token size)
_RACY_NS = 3_000_000_000  # a .bin modified more recently than this is verified but not cached


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """uint16 when every id fits (GPT-2's 50,257 does): half the disk and page cache of uint32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _code_of(dtype) -> int:
    return next(code for code, d in DTYPE_CODES.items() if np.dtype(d) == np.dtype(dtype))


def data_paths(prefix: str | Path) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx). The prefix is a path without extension, as in Megatron's --data-path."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def _sha256_file(path: Path, limit: int | None = None) -> bytes:
    """SHA-256 (raw 32 bytes, as the index stores it) of the first `limit` bytes (all when None), streamed."""
    return bytes.fromhex(file_sha256(path, limit=limit))


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx: `len(ds)` documents, `ds.doc(i)` (a numpy view of document i),
    `ds.num_tokens`, `ds.lengths` / `ds.offsets` (per-document arrays), `ds.tokens` (the whole flat stream).

    Opening checks magic, version, sizes and the index checksum, so a damaged index or a truncated .bin
    fails here with the path named; `verify_data()` additionally hashes the .bin (slow for a big corpus).
    A Megatron-LM / GPT-NeoX index (magic MMIDIDX) is data/indexed/megatron.py's MegatronIndexedDataset;
    data/indexed/formats.py's open_indexed opens either by the index's magic.
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = data_paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"indexed dataset file not found: {path} (prefix {self.prefix!r} needs "
                                        f"both {self.bin_path.name} and {self.idx_path.name})")
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER.size)
        if head[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{self.idx_path} is not a megazoo indexed dataset index: wrong magic bytes "
                             f"{head[:len(MAGIC)]!r} (expected {MAGIC!r}; a Megatron-LM index, b'MMIDIDX\\x00\\x00', opens with "
                             "data/indexed/formats.py's open_indexed)")
        if len(head) < HEADER.size:
            raise ValueError(f"{self.idx_path} is truncated: {idx_size} bytes, shorter than the header")
        _, version, dtype_code, len_code, count, bin_bytes, bin_sha = HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(f"{self.idx_path} has format version {version}; this megazoo reads version {VERSION}")
        if dtype_code not in (2, 4) or len_code not in (3, 5):
            raise ValueError(f"{self.idx_path} is corrupt: unknown dtype codes {dtype_code}/{len_code}")
        # Explicit little-endian dtypes: the files read the same on any machine.
        self.dtype = np.dtype(DTYPE_CODES[dtype_code]).newbyteorder("<")
        len_dtype = np.dtype(DTYPE_CODES[len_code]).newbyteorder("<")
        expected = HEADER.size + count * (len_dtype.itemsize + 8) + DIGEST_BYTES
        if idx_size != expected:
            raise ValueError(f"{self.idx_path} is truncated or corrupt: {idx_size} bytes, but its header "
                             f"({count} documents) needs {expected}")
        # Hash before trusting any array: a flipped bit in a length would otherwise read past a document.
        with open(self.idx_path, "rb") as f:
            f.seek(idx_size - DIGEST_BYTES)
            stored = f.read(DIGEST_BYTES)
        if _sha256_file(self.idx_path, idx_size - DIGEST_BYTES) != stored:
            raise ValueError(f"{self.idx_path} is corrupt: its checksum does not match its contents")
        actual_bin = self.bin_path.stat().st_size
        if actual_bin != bin_bytes:
            raise ValueError(f"{self.bin_path} is {'truncated' if actual_bin < bin_bytes else 'the wrong size'}: "
                             f"{actual_bin} bytes, but {self.idx_path.name} records {bin_bytes}")
        self._bin_sha = bin_sha
        self.checksum = stored.hex()  # identifies the exact contents: used in derived cache names
        self.lengths = np.memmap(self.idx_path, dtype=len_dtype, mode="r", offset=HEADER.size, shape=(count,)) \
            if count else np.zeros(0, len_dtype)
        self.offsets = np.memmap(self.idx_path, dtype="<i8", mode="r",
                                 offset=HEADER.size + count * len_dtype.itemsize, shape=(count,)) \
            if count else np.zeros(0, np.int64)
        # numpy cannot memmap an empty file, and an empty corpus is legal (if useless).
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if bin_bytes else np.zeros(0, self.dtype)
        self.num_tokens = bin_bytes // self.dtype.itemsize

    def __reduce__(self):
        # Pickle (e.g. to a DataLoader worker) as the prefix and reopen there, instead of copying the memmaps.
        return IndexedDataset, (self.prefix,)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.doc(index)

    def doc(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of document `index` (a read-only view), optionally only `length` tokens from `offset`."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} out of range for {len(self)} documents in {self.prefix}")
        index %= len(self)
        doc_start = int(self.offsets[index]) // self.dtype.itemsize
        doc_end = doc_start + int(self.lengths[index])
        start = doc_start + offset
        return self.tokens[start:doc_end if length is None else min(start + length, doc_end)]

    @property
    def verified_path(self) -> Path:
        return Path(str(self.bin_path) + VERIFIED_SUFFIX)

    def _verification_key(self, stat) -> dict:
        """What a cached verification must still match: the .bin's size and mtime and the checksums."""
        return {"bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns, "bin_sha256": self._bin_sha.hex(),
                "index_sha256": self.checksum}

    def _cached_verification(self) -> dict | None:
        try:
            record = json.loads(self.verified_path.read_text(encoding="utf-8"))
            fresh = self._verification_key(self.bin_path.stat())
            if isinstance(record, dict) and all(record.get(k) == v for k, v in fresh.items()) \
                    and isinstance(record.get("max_token"), int):
                return record
        except (OSError, ValueError):
            pass
        return None

    def _cache_verification(self, before, max_token: int) -> None:
        """Record a scan's result in PREFIX.bin.verified when the .bin did not change during it (and is not so
        fresh that a write within the mtime granularity could go unseen)."""
        after = self.bin_path.stat()
        settled = time.time_ns() - after.st_mtime_ns > _RACY_NS
        if settled and (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns):
            try:
                atomic_write_text(self.verified_path, json.dumps({**self._verification_key(after),
                                                                  "max_token": max_token}) + "\n")
            except OSError:
                pass  # a read-only dataset folder: verified, just not cached

    def verify_data(self, *, cache: bool = True) -> int:
        """Hash the whole .bin against the SHA-256 the writer recorded (catches in-place corruption); return the
        largest token id. With `cache`, a matching PREFIX.bin.verified skips the work, and a successful
        verification writes one (silently skipped where the folder is read-only)."""
        if cache and (record := self._cached_verification()) is not None:
            return record["max_token"]
        before = self.bin_path.stat()
        digest, max_token = hashlib.sha256(), -1
        with open(self.bin_path, "rb") as f:
            while block := f.read(_SCAN_BYTES):
                digest.update(block)
                tokens = np.frombuffer(block[:len(block) - len(block) % self.dtype.itemsize], dtype=self.dtype)
                if tokens.size:
                    max_token = max(max_token, int(tokens.max()))
        if digest.digest() != self._bin_sha:
            raise ValueError(f"{self.bin_path} is corrupt: its SHA-256 differs from the one in {self.idx_path.name}")
        if cache:
            self._cache_verification(before, max_token)
        return max_token

    def check_tokens(self, vocab_size: int) -> None:
        """Every token id is < vocab_size, or an error naming the file, the document and the token."""
        if self.verify_data() < vocab_size:
            return
        starts = self.offsets // self.dtype.itemsize
        step = _SCAN_BYTES // self.dtype.itemsize
        for lo in range(0, self.num_tokens, step):
            bad = np.flatnonzero(np.asarray(self.tokens[lo:lo + step]) >= vocab_size)
            if bad.size:
                position = lo + int(bad[0])
                doc = int(np.searchsorted(starts, position, side="right")) - 1
                raise ValueError(f"{self.bin_path}: document {doc} holds token id {int(self.tokens[position])} (its "
                                 f"token {position - int(starts[doc])}), outside the vocabulary [0, {vocab_size})")

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, documents={len(self)}, tokens={self.num_tokens}, dtype={self.dtype})"


class IndexedDatasetWriter:
    """Streams documents into PREFIX.bin/.idx. Use as a context manager: the files appear (atomically, by
    rename) only when the block ends without an exception; on error the temporary files are removed.

        with IndexedDatasetWriter("out/wiki", vocab_size=50257) as writer:
            writer.add_document([15496, 995, 50256])

    Memory holds one length per document (not the tokens), like Megatron's builder.
    """

    def __init__(self, prefix: str | Path, vocab_size: int, *, overwrite: bool = False) -> None:
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = data_paths(prefix)
        self.overwrite = overwrite
        self.vocab_size = vocab_size
        self.dtype = np.dtype(token_dtype(vocab_size))
        self._refuse_existing()
        directory = self.bin_path.parent
        if not directory.is_dir():
            raise FileNotFoundError(f"output directory {directory} does not exist (output prefix {self.prefix!r})")
        # Temporary files beside the targets, so the final os.replace is a same-filesystem atomic rename.
        self._bin_file = AtomicFile(self.bin_path)
        self._bin = self._bin_file.file
        self._sha = hashlib.sha256()
        self._lengths = array("q")
        self._bytes = 0
        self._closed = False

    def _refuse_existing(self) -> None:
        existing = [str(p) for p in (self.bin_path, self.idx_path) if p.exists()]
        if existing and not self.overwrite:
            raise FileExistsError(f"output {' and '.join(existing)} already exists; choose another output prefix "
                                  f"or pass overwrite=True (--overwrite)")

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return self._bytes // self.dtype.itemsize

    def add_document(self, ids) -> None:
        """Append one document (any sequence of ints)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.add_documents(ids, [len(ids)])

    def add_documents(self, tokens: np.ndarray, lengths) -> None:
        """Append several documents at once: `tokens` is their concatenation, `lengths` their sizes (the fast
        path for the preprocessor: one write and one range check per chunk, not per document)."""
        if self._closed:
            raise RuntimeError(f"writer for {self.prefix} is already closed")
        tokens = np.asarray(tokens).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != len(tokens) or (lengths.size and lengths.min() < 0):
            raise ValueError(f"document lengths {lengths.tolist()[:8]}... do not add up to {len(tokens)} tokens")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens.min() if tokens.min() < 0 else tokens.max())
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size}) of {self.prefix}")
        data = tokens.astype(self.dtype, copy=False).astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self._bin.write(data)
        self._sha.update(data)
        self._bytes += len(data)
        self._lengths.extend(lengths.tolist())

    def finalize(self) -> IndexedDataset:
        """Write the index, rename both files into place, and return the dataset opened for reading."""
        if self._closed:
            raise RuntimeError(f"writer for {self.prefix} is already closed")
        try:
            self._bin_file.sync()
            lengths = np.frombuffer(self._lengths, dtype=np.int64) if len(self._lengths) else np.zeros(0, np.int64)
            offsets = np.zeros(len(lengths), dtype=np.int64)
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=offsets[1:])
            len_dtype = np.int32 if not lengths.size or lengths.max() < 1 << 31 else np.int64
            body = HEADER.pack(MAGIC, VERSION, _code_of(self.dtype), _code_of(len_dtype), len(lengths),
                               self._bytes, self._sha.digest())
            body += lengths.astype(np.dtype(len_dtype).newbyteorder("<")).tobytes()
            body += offsets.astype("<i8").tobytes()
            idx_file = AtomicFile(self.idx_path)
            try:
                idx_file.file.write(body + hashlib.sha256(body).digest())
                idx_file.sync()
                self._refuse_existing()  # another process may have created the prefix while we were writing
                # .bin first, .idx last: a reader that sees the new .idx also sees the .bin it describes.
                self._bin_file.commit()
                idx_file.commit()
            finally:
                idx_file.discard()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return IndexedDataset(self.prefix)

    def abort(self) -> None:
        """Drop everything written so far; the output prefix is left as it was."""
        self._bin_file.discard()
        self._closed = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        elif not self._closed:
            self.abort()
