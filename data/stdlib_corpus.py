"""The Python standard library's own source as a real text corpus.

Every machine that runs Python has it, so tests and demo runs can train on real text without a download.
"""

import hashlib
import os
import sysconfig
from pathlib import Path

# Directories skipped at any depth: installed third-party code, the stdlib's test suites (huge, repetitive
# fixtures), bundled tools that are not ordinary library code, and the codec tables of encodings/ (generated
# character maps that would dominate a small sample).
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__",
                           "encodings"})


def stdlib_documents(max_bytes: int | None = None) -> list[tuple[str, str]]:
    """(relative_path, text) of the stdlib's `.py` files, sorted by relative path.

    Files that are not valid UTF-8 are skipped. With `max_bytes`, documents are taken whole, in order, until
    their total UTF-8 size reaches `max_bytes` (the last one may overshoot; documents are never cut).
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    documents: list[tuple[str, str]] = []
    total_bytes = 0
    for relative_path in _stdlib_source_paths(root):
        raw = (root / relative_path).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        documents.append((relative_path, text))
        total_bytes += len(raw)
        if max_bytes is not None and total_bytes >= max_bytes:
            break
    return documents


def _stdlib_source_paths(root: Path) -> list[str]:
    paths: list[str] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        for name in files:
            if name.endswith(".py"):
                # POSIX form so the split hash is the same on every OS.
                paths.append(Path(directory, name).relative_to(root).as_posix())
    return sorted(paths)


def split_train_val(docs: list[tuple[str, str]], val_fraction: float) -> tuple[list[str], list[str]]:
    """Split documents into (train_texts, val_texts) by a stable hash of each relative path.

    A document's side depends only on its path, not on the order of `docs` or how many were read, so growing
    max_bytes never moves a validation file into training. With >= 2 documents both sides are non-empty.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    scores = [_path_score(path) for path, _ in docs]
    is_val = [score < val_fraction for score in scores]
    if len(docs) >= 2:
        # Degenerate fractions/tiny corpora: move the lowest-scoring doc to val or the highest to train.
        if not any(is_val):
            is_val[min(range(len(docs)), key=scores.__getitem__)] = True
        if all(is_val):
            is_val[max(range(len(docs)), key=scores.__getitem__)] = False
    train = [text for (_, text), val in zip(docs, is_val) if not val]
    val = [text for (_, text), val in zip(docs, is_val) if val]
    return train, val


def _path_score(relative_path: str) -> float:
    """Uniform in [0, 1), stable across runs and machines (unlike the salted builtin hash())."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
