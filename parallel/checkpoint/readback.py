"""A checkpoint counts as saved once it reads back: the hash of what was meant, and the check against the disk.

Every byte a rank hands to a checkpoint file goes through `HashingWriter`, so the sha256 recorded in the manifest
is that of the bytes *meant* (never of whatever landed on disk). With verification on (checkpoint.verify_on_save,
the default) the rank then fsyncs, asks the kernel to drop the file's cached pages (so the re-read comes from the
storage, or the network filesystem's server, rather than from this node's page cache) and re-reads the whole file:
a size or sha256 that differs from the bytes meant is a failed save, found before the oldest checkpoint is
rotated away. With it off the manifest still records the meant hash, so the same damage is found on load.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from megazoo.data.fileio import file_sha256


class HashingWriter:
    """A write-only file object over `f` that hashes every byte written through it (what torch.save writes)."""

    def __init__(self, f):
        self.file, self.sha = f, hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.bytes += view.nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


def drop_cached_pages(fd: int) -> None:
    """After fsync: forget this file's pages in the page cache, so the next read goes to the storage. Only where
    the platform has posix_fadvise (Linux); elsewhere the re-read may be served from memory."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # advice only: a filesystem that refuses it still gets the re-read


def read_back_problem(path: Path, meant_sha256: str, meant_bytes: int) -> str | None:
    """None when `path` holds exactly the bytes meant; else one line naming the file and what differs."""
    size = path.stat().st_size
    if size != meant_bytes:
        return f"checkpoint file {path} did not read back as written: {size} bytes on disk, {meant_bytes} written"
    found = file_sha256(path)
    if found != meant_sha256:
        return (f"checkpoint file {path} did not read back as written: sha256 {found[:16]}... on disk, "
                f"{meant_sha256[:16]}... written")
    return None
