"""Fixed-length GPT training samples over an indexed dataset, Megatron-LM style.

Three index arrays describe the samples, built once with vectorised numpy and cached as .npy:

- doc_idx [E * N]: the document order. Each of the E epochs is its own permutation of the N documents, so
  epoch e's tokens fill stream positions [e*T, (e+1)*T) exactly (T = tokens in the dataset). (Megatron shuffles
  the first E-1 epochs jointly; per-epoch shuffles make "every token once per epoch" exact.)
- sample_idx [S, 2]: for stream sample s, the (position in doc_idx, token offset in that document) where it
  starts. Sample s covers stream tokens [s*seq_len, s*seq_len + seq_len], seq_len + 1 tokens: inputs are
  sample[:-1], targets sample[1:], and consecutive samples share one boundary token, as in Megatron and
  TokenSamples. Samples run across document boundaries (the eod token separates documents).
  S = (E*T - 1) // seq_len: only the final partial sample of the stream is dropped.
- shuffle_idx [len]: dataset index -> stream sample. The samples of the first E-1 epochs and those of the
  last one are shuffled separately (Megatron's separate_last_epoch), so when `num_samples` uses only part of
  the last epoch, the kept samples still cover every earlier epoch completely.

Cache files are named by the data file's checksum, seed, seq_len, epochs and sample count, and are written
to temporary names and renamed: several ranks may build the same index at once, and since the build is
deterministic every rename publishes identical bytes.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from megazoo.data.fileio import atomic_write
from megazoo.data.indexed.dataset import IndexedDataset

INDEX_VERSION = 1  # bump when the algorithm changes, so old caches are not reused
_CHUNK_SAMPLES = 1 << 22  # sample starts located per searchsorted call: bounds the build's temporary memory
_KINDS = ("doc_idx", "sample_idx", "shuffle_idx")


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save to a temporary name beside `path`, then rename: readers see no file or a whole one, and
    concurrent writers of the same deterministic array just replace identical bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        np.save(f, array)


def _smallest_int(upper: int) -> type[np.signedinteger]:
    """int32 when every value < upper fits: halves the cache and its page-cache footprint."""
    return np.int32 if upper < 1 << 31 else np.int64


def build_doc_idx(num_docs: int, num_epochs: int, rng: np.random.Generator) -> np.ndarray:
    """E independent permutations of range(num_docs), concatenated."""
    dtype = _smallest_int(num_docs)
    doc_idx = np.empty(num_docs * num_epochs, dtype=dtype)
    for epoch in range(num_epochs):
        doc_idx[epoch * num_docs:(epoch + 1) * num_docs] = rng.permutation(num_docs)
    return doc_idx


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_len: int, num_samples: int) -> np.ndarray:
    """[num_samples, 2] (position in doc_idx, offset in that document) of each sample start s * seq_len.

    Vectorised: with ends[p] = tokens up to and including doc_idx[p], the start lies in the first position
    whose end exceeds it (searchsorted side="right" also steps over empty documents).
    """
    doc_sizes = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(doc_sizes)
    dtype = _smallest_int(max(len(doc_idx), int(sizes.max(initial=0)) + 1))
    sample_idx = np.empty((num_samples, 2), dtype=dtype)
    for lo in range(0, num_samples, _CHUNK_SAMPLES):
        starts = np.arange(lo, min(lo + _CHUNK_SAMPLES, num_samples), dtype=np.int64) * seq_len
        positions = np.searchsorted(ends, starts, side="right")
        sample_idx[lo:lo + len(starts), 0] = positions
        sample_idx[lo:lo + len(starts), 1] = starts - (ends[positions] - doc_sizes[positions])
    return sample_idx


def build_shuffle_idx(num_samples: int, separate_from: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """Permute [0, separate_from) and [separate_from, num_samples) separately, concatenate, keep `length`."""
    dtype = _smallest_int(num_samples)
    first = rng.permutation(separate_from).astype(dtype)
    last = (separate_from + rng.permutation(num_samples - separate_from)).astype(dtype)
    return np.concatenate([first, last])[:length]


class GPTDataset:
    """`seq_len + 1`-token samples over an IndexedDataset, for `num_epochs` passes or exactly `num_samples`.

    `len(ds)`, `ds[i] -> LongTensor[seq_len + 1]`, `ds.stack(indices) -> LongTensor[n, seq_len + 1]` (the
    TokenSamples interface the training loop and GlobalBatchSampler use). The same (data, seed, seq_len,
    size) always gives the same samples in the same order. `cache_dir` defaults to the data's folder; when it
    is not writable the index is kept in memory only (with a warning).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_len: int,
        seed: int,
        *,
        num_epochs: int | None = None,
        num_samples: int | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if (num_epochs is None) == (num_samples is None):
            raise ValueError("give exactly one of num_epochs and num_samples")
        tokens = int(indexed.num_tokens)
        if tokens == 0:
            raise ValueError(f"indexed dataset {indexed.prefix} has no tokens")
        if num_samples is not None:
            if num_samples < 1:
                raise ValueError(f"num_samples must be >= 1, got {num_samples}")
            # Smallest E with (E*T - 1) // seq_len >= num_samples, i.e. E*T >= num_samples*seq_len + 1.
            num_epochs = -(-(num_samples * seq_len + 1) // tokens)
        elif num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
        total = (num_epochs * tokens - 1) // seq_len
        if total < 1:
            raise ValueError(f"indexed dataset {indexed.prefix} has {tokens} tokens: {num_epochs} epoch(s) cannot "
                             f"make one sample of seq_len {seq_len} (needs {seq_len + 1} tokens)")
        self.indexed = indexed
        self.seq_len = seq_len
        self.seed = seed
        self.num_epochs = num_epochs
        self.tokens_per_epoch = tokens
        self.num_samples = total if num_samples is None else num_samples
        # Stream samples lying wholly in the first E-1 epochs: shuffled apart from the last epoch's samples.
        self._separate_from = ((num_epochs - 1) * tokens - 1) // seq_len if num_epochs > 1 else 0
        self._total = total
        directory = Path(cache_dir) if cache_dir is not None else Path(indexed.prefix).parent
        stem = (f"{Path(indexed.prefix).name}.gpt-v{INDEX_VERSION}-{indexed.checksum[:16]}-s{seed}-sl{seq_len}"
                f"-ep{num_epochs}-ns{self.num_samples}")
        self.cache_paths = {kind: directory / f"{stem}.{kind}.npy" for kind in _KINDS}
        self.loaded_from_cache = False
        arrays = self._load_cache()
        if arrays is None:
            arrays = self._build()
            self._save_cache(arrays, directory)
        else:
            self.loaded_from_cache = True
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # Two independent streams from the seed: the document order does not depend on how many samples the
        # shuffle draws, and vice versa.
        doc_rng = np.random.default_rng([self.seed, 0])
        sample_rng = np.random.default_rng([self.seed, 1])
        sizes = np.asarray(self.indexed.lengths)
        doc_idx = build_doc_idx(len(sizes), self.num_epochs, doc_rng)
        sample_idx = build_sample_idx(sizes, doc_idx, self.seq_len, self._total)
        shuffle_idx = build_shuffle_idx(self._total, self._separate_from, self.num_samples, sample_rng)
        return doc_idx, sample_idx, shuffle_idx

    def _load_cache(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if not all(path.is_file() for path in self.cache_paths.values()):
            return None
        try:
            doc_idx, sample_idx, shuffle_idx = (np.load(self.cache_paths[k], mmap_mode="r") for k in _KINDS)
        except (OSError, ValueError, EOFError) as error:
            warnings.warn(f"ignoring unreadable sample-index cache {self.cache_paths['doc_idx'].parent}: {error}")
            return None
        if (doc_idx.shape != (len(self.indexed) * self.num_epochs,) or sample_idx.shape != (self._total, 2)
                or shuffle_idx.shape != (self.num_samples,)):
            warnings.warn(f"ignoring sample-index cache with unexpected shapes: {self.cache_paths['doc_idx']}")
            return None
        return doc_idx, sample_idx, shuffle_idx

    def _save_cache(self, arrays: tuple[np.ndarray, ...], directory: Path) -> None:
        try:
            for kind, array in zip(_KINDS, arrays):
                save_npy_atomic(self.cache_paths[kind], array)
        except OSError as error:
            warnings.warn(f"could not cache the sample index in {directory} ({error}); keeping it in memory")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.stack([index])[0]

    def stream_sample(self, sample: int) -> np.ndarray:
        """Stream sample `sample` (before shuffling): seq_len + 1 tokens read document by document."""
        position, offset = (int(v) for v in self.sample_idx[sample])
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        filled = 0
        while filled < len(out):
            doc = int(self.doc_idx[position])
            piece = self.indexed.doc(doc, offset, len(out) - filled)
            out[filled:filled + len(piece)] = piece
            filled += len(piece)
            position, offset = position + 1, 0
        return out

    def stack(self, indices) -> torch.Tensor:
        """LongTensor[len(indices), seq_len + 1] of the samples at these dataset indices."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_samples):
            bad = int(indices.min() if indices.min() < 0 else indices.max())
            raise IndexError(f"sample index {bad} out of range [0, {self.num_samples})")
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            out[row] = self.stream_sample(int(self.shuffle_idx[index]))
        return torch.from_numpy(out)

    def __repr__(self) -> str:
        return (f"GPTDataset({self.indexed.prefix!r}, seq_len={self.seq_len}, seed={self.seed}, "
                f"epochs={self.num_epochs}, samples={self.num_samples})")
