"""Token arrays as fixed-length training samples, and the cached stdlib demo corpus."""

import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megazoo.data.stdlib_corpus import split_train_val, stdlib_documents
from megazoo.data.tokenizers.tokenizer import BPETokenizer


class TokenSamples:
    """Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1].

    seq_len + 1 tokens per sample: inputs are sample[:-1] and targets sample[1:], so consecutive samples
    share one boundary token and no token is wasted as a target.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"{len(tokens)} tokens cannot make one sample of seq_len {seq_len}: need at least {seq_len + 1}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.stack([index])[0]

    def stack(self, indices: list[int]) -> torch.Tensor:
        """LongTensor[len(indices), seq_len + 1]."""
        starts = np.asarray(indices, dtype=np.int64).reshape(-1)
        if starts.size and (starts.min() < 0 or starts.max() >= self.num_samples):
            bad = int(starts.min() if starts.min() < 0 else starts.max())
            raise IndexError(f"sample index {bad} out of range [0, {self.num_samples})")
        positions = starts[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return torch.from_numpy(self.tokens[positions].astype(np.int64))


def synthetic_tokens(num_tokens: int, vocab_size: int, seed: int, successors: int = 4) -> np.ndarray:
    """Deterministic int64 tokens in [0, vocab_size) for tests: a random first-order Markov chain in which each
    token is followed by one of `successors` fixed tokens, so a model can learn it (the loss falls from
    ln(vocab_size) towards ln(successors)) while every token id still occurs."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab_size, size=(vocab_size, successors), dtype=np.int64)
    choice = rng.integers(0, successors, size=num_tokens, dtype=np.int64)
    tokens = np.empty(num_tokens, dtype=np.int64)
    current = int(rng.integers(0, vocab_size))
    for i in range(num_tokens):
        tokens[i] = current
        current = int(table[current, choice[i]])
    return tokens


@dataclass(frozen=True, eq=False)  # eq would compare arrays elementwise
class DemoCorpus:
    tokenizer: BPETokenizer
    train_tokens: np.ndarray  # 1-D, every document followed by eod
    val_tokens: np.ndarray


class DataCacheError(RuntimeError):
    """The data cache could not be written (ENOSPC, EDQUOT, EROFS): said in one line, nothing partial left."""


def build_stdlib_corpus(
    cache_dir: str | Path, vocab_size: int, max_bytes: int, val_fraction: float, seed: int
) -> DemoCorpus:
    """Train a BPE tokenizer on stdlib train documents and tokenize both splits, cached in `cache_dir`.

    `seed` shuffles the order of train documents in the token stream, so a sample window rarely spans two
    files from one package. The cache entry is a directory named by every setting (and the Python version,
    whose stdlib is the corpus); changing any of them builds a new entry.

    Safe to call from several processes at once (torchrun ranks): each builds into its own temporary
    directory and renames it into place. Renaming a directory onto an existing one fails, so the first
    finisher wins and every process returns that entry: all ranks see the same tokenizer and tokens.
    """
    entry = Path(cache_dir) / (
        f"stdlib-py{platform.python_version()}-v{vocab_size}-b{max_bytes}-val{val_fraction!r}-s{seed}"
    )
    if entry.is_dir():
        return _load_entry(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        corpus = _build(vocab_size, max_bytes, val_fraction, seed)
        corpus.tokenizer.save(staging / "tokenizer.json")
        np.save(staging / "train.npy", corpus.train_tokens)
        np.save(staging / "val.npy", corpus.val_tokens)
        os.replace(staging, entry)
        return corpus
    except OSError as err:
        if not entry.is_dir():  # a full disk, a quota, a read-only cache: the staging folder goes (finally)
            reason = err.strerror or str(err)
            if err.errno is None and "written" in reason:  # numpy's short write: the file system filled up
                reason = f"No space left on device: {reason}"
            free = shutil.disk_usage(entry.parent).free
            raise DataCacheError(f"cannot write the data cache entry {entry} ({reason}; {free:,} bytes free "
                                 f"there); nothing was kept (its partial files are removed): free space in "
                                 f"{entry.parent} or choose another run.dir") from err
        return _load_entry(entry)  # another process published first: use its entry
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _build(vocab_size: int, max_bytes: int, val_fraction: float, seed: int) -> DemoCorpus:
    train_texts, val_texts = split_train_val(stdlib_documents(max_bytes), val_fraction)
    order = np.random.default_rng(seed).permutation(len(train_texts))
    train_texts = [train_texts[i] for i in order]
    tokenizer = BPETokenizer.train(train_texts, vocab_size)
    return DemoCorpus(
        tokenizer=tokenizer,
        train_tokens=_concat_with_eod(tokenizer, train_texts),
        val_tokens=_concat_with_eod(tokenizer, val_texts),
    )


def _concat_with_eod(tokenizer: BPETokenizer, texts: list[str]) -> np.ndarray:
    # uint16 halves memory and disk whenever every id fits, as it does for demo vocabularies.
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    encoded = tokenizer.encode_batch(texts)
    tokens = np.empty(sum(len(ids) + 1 for ids in encoded), dtype=dtype)
    position = 0
    for ids in encoded:
        tokens[position : position + len(ids)] = ids
        tokens[position + len(ids)] = tokenizer.eod_id
        position += len(ids) + 1
    return tokens


def _load_entry(entry: Path) -> DemoCorpus:
    tokenizer = BPETokenizer.load(entry / "tokenizer.json")
    arrays = {}
    for split in ("train", "val"):
        path = entry / f"{split}.npy"
        try:
            arrays[split] = np.load(path)
        except (OSError, ValueError, EOFError) as error:
            raise ValueError(f"cached token file {path} is missing or corrupt ({error}); delete {entry}") from error
        if arrays[split].ndim != 1 or (arrays[split].size and int(arrays[split].max()) >= tokenizer.vocab_size):
            raise ValueError(f"cached token file {path} does not match {entry / 'tokenizer.json'}; delete {entry}")
    return DemoCorpus(tokenizer=tokenizer, train_tokens=arrays["train"], val_tokens=arrays["val"])
