"""The file helpers every layer shares: atomic writes and a streamed SHA-256. Standard library only.

An atomic write goes to a temporary file beside the target (same folder, so same filesystem), is flushed and
fsynced, and only then renamed over the target with os.replace: a reader, or the next run after a crash, sees
the old file or the whole new one, never a part. When the write fails, the temporary file is removed and the
old file is left as it was.

- `atomic_write(path, mode)`: a context manager yielding the open temporary file; published when the block
  ends without an exception.
- `atomic_write_bytes(path, data)` / `atomic_write_text(path, text)`: the one-call forms.
- `AtomicFile(path)`: the same, for writers that stream into the file over a long time and publish it later
  (`commit()`), or drop it (`discard()`), e.g. the indexed-dataset writer.
- `write_new_file(path, data)`: all or nothing, and never over an existing file (hard link, not rename).
- `staged_out_dir(out_dir, overwrite)`: a whole output folder written beside it and renamed into place at the end
  (nothing half-written after a failure); `check_out_dir` refuses a non-empty one first unless `overwrite`.
- `file_sha256(path)`: hex SHA-256 of a file (or of its first `limit` bytes), read in 1 MiB blocks.

Home: data/ is the lowest layer, so data/, models/, eval/ and recipes/ may all import it (tests/test_style.py).
"""

from __future__ import annotations

import glob
import hashlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

_BLOCK = 1 << 20


class AtomicFile:
    """A temporary file beside `path`, open for writing as `.file`, that replaces `path` only on `commit()`.

    `discard()` (safe to call at any time, also after `commit()`) closes and removes the temporary file."""

    def __init__(self, path: str | Path, mode: str = "wb", *, encoding: str | None = None) -> None:
        if "w" not in mode:
            raise ValueError(f"AtomicFile mode {mode!r} must be a write mode ('wb' or 'w')")
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"cannot write {self.path}: directory {self.path.parent} does not exist")
        # A fresh name opened with "x" (never an existing file), with the permissions a plain open() gives
        # (tempfile.mkstemp would make it 0600).
        while True:
            self.tmp_path = self.path.with_name(f".{self.path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
            try:
                self.file: IO = open(self.tmp_path, mode.replace("w", "x"), encoding=encoding)
                break
            except FileExistsError:
                continue
        self.committed = False

    def sync(self) -> None:
        """Flush, fsync and close the temporary file (its bytes are on disk; not yet under `path`)."""
        if not self.file.closed:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()

    def commit(self) -> Path:
        """sync(), then rename the temporary file over `path` (atomic); returns `path`."""
        self.sync()
        os.replace(self.tmp_path, self.path)
        self.committed = True
        return self.path

    def discard(self) -> None:
        """Close and remove the temporary file; `path` is left as it was (no-op after a commit)."""
        if not self.file.closed:
            self.file.close()
        if not self.committed:
            self.tmp_path.unlink(missing_ok=True)


def stale_temp_files(path: str | Path) -> list[Path]:
    """AtomicFile temporaries of `path` whose writer is no longer running on this host (killed by SIGKILL or a
    power cut, which no handler sees): safe to remove. A live writer's file is never listed."""
    path = Path(path)
    stale = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*-*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            stale.append(tmp)
        except PermissionError:
            pass  # alive, another user's
    return sorted(stale)


@contextmanager
def atomic_write(path: str | Path, mode: str = "wb", *, encoding: str | None = None) -> Iterator[IO]:
    """`with atomic_write(path) as f: f.write(...)`: `path` gets the new contents when the block ends without
    an exception, and keeps its old contents (or stays absent) when it raises."""
    target = AtomicFile(path, mode, encoding=encoding)
    try:
        yield target.file
        target.commit()
    finally:
        target.discard()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data`, atomically (see the module docstring)."""
    with atomic_write(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Replace `path` with `text` (no newline translation), atomically."""
    atomic_write_bytes(path, text.encode(encoding))


def write_new_file(path: str | Path, data: bytes) -> None:
    """Write `data` to `path`, which must not exist: all or nothing, and never over an existing file.

    The bytes go to a temporary file beside `path` that is then hard-linked into place (link fails when
    `path` exists, even if it appeared meanwhile), so a crash never leaves a half-written file.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists; not overwriting it (remove it or choose another output)")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise FileExistsError(f"{path} already exists; not overwriting it") from None
        except OSError:  # a filesystem without hard links: fall back to an exists-check + rename
            if path.exists():
                raise FileExistsError(f"{path} already exists; not overwriting it") from None
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def file_sha256(path: str | Path, *, limit: int | None = None) -> str:
    """Hex SHA-256 of the file at `path`, streamed; of its first `limit` bytes only when `limit` is given."""
    digest = hashlib.sha256()
    remaining = limit
    with open(path, "rb") as f:
        while remaining is None or remaining > 0:
            block = f.read(_BLOCK if remaining is None else min(_BLOCK, remaining))
            if not block:
                break
            digest.update(block)
            if remaining is not None:
                remaining -= len(block)
    return digest.hexdigest()


def check_out_dir(out_dir: str | Path, overwrite: bool = False) -> Path:
    """Refuse an existing non-empty `out_dir` (or a file there), so no earlier result is ever overwritten;
    `overwrite`: an existing folder may be replaced (staged_out_dir swaps it only once the new one is complete)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"output {out_dir} exists and is a file, not a directory: choose a new --out")
    if out_dir.exists() and not overwrite and any(out_dir.iterdir()):
        raise ValueError(f"output directory {out_dir} exists and is not empty: choose a new --out, or pass "
                         "--overwrite to replace it once the new one is complete (nothing is overwritten)")
    return out_dir


def ensure_empty_out_dir(out_dir: str | Path) -> Path:
    """`out_dir`, created if needed; refuses a non-empty one so no earlier result is ever overwritten."""
    out_dir = check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def _plain_modes(folder: Path) -> None:
    """Give `folder` and everything in it the modes a plain mkdir / open would under the user's umask:
    mkdtemp makes the folder 0700 and safetensors writes its file 0600, which shared storage cannot read."""
    umask = os.umask(0o022)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def staged_out_dir(out_dir: str | Path, overwrite: bool = False):
    """Yield a fresh temporary directory beside `out_dir`, renamed to `out_dir` only when the block succeeds:
    an interrupted or failed conversion leaves no half-written output (the temporary one is removed), and
    `out_dir` is untouched until then. `overwrite`: an existing `out_dir` is moved aside, the new one renamed in,
    and only then the old one removed (a crash between the two renames leaves both, never a part of either)."""
    out_dir = check_out_dir(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old: Path | None = None
    try:
        yield staging
        _plain_modes(staging)
        check_out_dir(out_dir, overwrite)  # nobody wrote there meanwhile
        if out_dir.is_dir() and (overwrite and any(out_dir.iterdir())):
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
        elif out_dir.is_dir():
            out_dir.rmdir()  # empty (checked): replaced by the finished one
        try:
            os.replace(staging, out_dir)
        except OSError:
            if old is not None:  # the old one back where it was
                os.replace(old / out_dir.name, out_dir)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and out_dir.is_dir():  # the new one is in place: the old one goes
            shutil.rmtree(old, ignore_errors=True)
