"""Checkpoints verified on save (issue 32): a file that does not read back as the bytes meant is caught before the
oldest checkpoint is rotated away, the older checkpoints survive, the new one is kept aside as bad-step_N, and the
error is one line naming the file; checkpoint.verify_on_save = false skips the re-read (load still catches it)."""

from __future__ import annotations

import pytest
from checkpoint_helpers import FlippingWriter
from harness import run_distributed
from recipe_helpers import tiny_resolved

from megazoo.parallel.checkpoint import io as ckpt_io
from megazoo.parallel.checkpoint.io import CheckpointError, CheckpointReadBackError, latest_good_checkpoint, verify_checkpoint
from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer


def _trainer(tmp_path, parallel=None, **checkpoint):
    parallel = parallel or {}
    res = tiny_resolved(parallel=parallel, train={"steps": 3, "micro_batch": 4 // parallel.get("dp", 1)},
                        run={"dir": str(tmp_path)}, checkpoint={"every": 1, "keep": 2, **checkpoint})
    topo = Topology.build(parallel["dp"]) if parallel else Topology.solo()
    return Trainer(res, topo)


def _save_two_then_corrupt_third(trainer, monkeypatch_writer):
    for step in range(2):
        trainer.train_step(step)
        trainer.save_checkpoint(step + 1)
    trainer.train_step(2)
    monkeypatch_writer()
    trainer.save_checkpoint(3)


def _assert_previous_kept(root):
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["bad-step_00000003", "step_00000001",
                                                                    "step_00000002"]
    assert (root / "latest").read_text() == "step_00000002"
    assert latest_good_checkpoint(root, report=lambda *_: None) == root / "step_00000002"
    assert "did not read back as written" in (root / "bad-step_00000003" / "BAD").read_text()


def test_corrupted_write_is_caught_and_previous_checkpoints_survive(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    with pytest.raises(CheckpointReadBackError) as info:
        _save_two_then_corrupt_third(trainer, lambda: monkeypatch.setattr(ckpt_io, "HashingWriter", FlippingWriter))
    message = str(info.value)
    root = tmp_path / "checkpoints"
    assert "\n" not in message
    assert f"checkpoint file {root / '.tmp-step_00000003' / 'rank00000.pt'} did not read back as written" in message
    assert "marked bad" in message and "previous checkpoints are kept" in message
    _assert_previous_kept(root)  # keep = 2: without the check, step 1 would have been rotated away


def _dp2_corrupt_rank1(tmp_path):
    trainer = _trainer(tmp_path, parallel={"dp": 2})

    def inject():
        FlippingWriter.rank = 1
        ckpt_io.HashingWriter = FlippingWriter  # a forked rank: the parent's module is untouched
    try:
        _save_two_then_corrupt_third(trainer, inject)
    except CheckpointReadBackError as err:
        return str(err)
    return None


def test_one_ranks_corrupted_file_stops_every_rank_naming_it(tmp_path):
    messages = run_distributed(_dp2_corrupt_rank1, 2, tmp_path)
    for message in messages:  # every rank stops with the same line, naming rank 1's file
        assert message is not None and "rank 1 on host" in message
        assert "rank00001.pt did not read back as written" in message and "rank00000.pt" not in message
    _assert_previous_kept(tmp_path / "checkpoints")


def test_verify_off_skips_the_reread_and_load_still_catches_it(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, verify_on_save=False)
    _save_two_then_corrupt_third(trainer, lambda: monkeypatch.setattr(ckpt_io, "HashingWriter", FlippingWriter))
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_00000003"  # published: nothing re-read it
    with pytest.raises(CheckpointError, match=r"step_00000003/rank00000.pt is corrupt"):
        verify_checkpoint(root / "step_00000003")  # the manifest holds the hash of the bytes meant


def test_clean_save_records_the_hash_of_the_bytes_written(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train_step(0)
    path = trainer.save_checkpoint(1)
    manifest = verify_checkpoint(path)
    assert set(manifest["files"]) == {"rank00000.pt", "common.json"}
