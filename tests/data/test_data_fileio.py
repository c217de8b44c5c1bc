"""data/fileio.py: atomic writes (the old file survives a failed write, no temporary debris) and file_sha256."""

from __future__ import annotations

import hashlib
import os
import stat

import numpy as np
import pytest

from megazoo.data.fileio import (AtomicFile, atomic_write, atomic_write_bytes, atomic_write_text, file_sha256,
                                 write_new_file)
from megazoo.data.gpt_dataset import save_npy_atomic

ABC_SHA256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2 test vector "abc"
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def _only(folder, name):
    assert sorted(p.name for p in folder.iterdir()) == [name], "temporary files left behind"


def test_file_sha256_of_known_contents(tmp_path):
    (tmp_path / "abc").write_bytes(b"abc")
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(tmp_path / "abc") == ABC_SHA256
    assert file_sha256(str(tmp_path / "empty")) == EMPTY_SHA256
    big = os.urandom((1 << 20) * 2 + 123)  # more than one read block
    (tmp_path / "big").write_bytes(big)
    assert file_sha256(tmp_path / "big") == hashlib.sha256(big).hexdigest()
    assert file_sha256(tmp_path / "big", limit=(1 << 20) + 7) == hashlib.sha256(big[:(1 << 20) + 7]).hexdigest()
    assert file_sha256(tmp_path / "abc", limit=0) == EMPTY_SHA256


def test_atomic_write_replaces_the_file(tmp_path):
    path = tmp_path / "out.json"
    atomic_write_text(path, "old\n")
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"
    atomic_write_text(path, "h\u00e9\n")
    assert path.read_bytes() == "h\u00e9\n".encode()
    _only(tmp_path, "out.json")


def test_a_failed_atomic_write_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("the last good one")
    with pytest.raises(RuntimeError, match="disk gone"):
        with atomic_write(path) as f:
            f.write(b"half of the new on")
            raise RuntimeError("disk gone")
    assert path.read_text() == "the last good one"
    _only(tmp_path, "result.json")
    with pytest.raises(TypeError):  # a failure inside the helper itself (str to a binary file)
        atomic_write_bytes(path, "not bytes")
    assert path.read_text() == "the last good one"
    _only(tmp_path, "result.json")


def test_a_failed_atomic_write_creates_nothing(tmp_path):
    with pytest.raises(ValueError):
        with atomic_write(tmp_path / "new.npy") as f:
            np.save(f, np.arange(3))
            raise ValueError("stop")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_write_bytes(tmp_path / "no" / "such" / "dir.bin", b"x")


def test_atomic_file_commits_or_discards(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"old")
    pending = AtomicFile(path)
    pending.file.write(b"streamed")
    assert path.read_bytes() == b"old"  # nothing visible before the commit
    pending.discard()
    assert path.read_bytes() == b"old"
    _only(tmp_path, "tokens.bin")
    done = AtomicFile(path)
    done.file.write(b"streamed")
    assert done.commit() == path and path.read_bytes() == b"streamed"
    done.discard()  # after a commit: nothing to do, the file stays
    assert path.read_bytes() == b"streamed"
    _only(tmp_path, "tokens.bin")


def test_atomic_writes_get_the_usual_permissions(tmp_path):
    """Not tempfile.mkstemp's 0600: a result or a cache file is as readable as one open() would make."""
    umask = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "a", b"x")
        (tmp_path / "b").write_bytes(b"x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o644


def test_save_npy_atomic_round_trips(tmp_path):
    path = tmp_path / "cache" / "idx.npy"
    save_npy_atomic(path, np.arange(10, dtype=np.int32))
    save_npy_atomic(path, np.arange(5, dtype=np.int64))
    assert np.load(path).tolist() == list(range(5))
    _only(path.parent, "idx.npy")


def test_write_new_file_never_overwrites(tmp_path):
    path = tmp_path / "tok.model"
    write_new_file(path, b"first")
    with pytest.raises(FileExistsError, match="already exists"):
        write_new_file(path, b"second")
    assert path.read_bytes() == b"first"
    _only(tmp_path, "tok.model")
