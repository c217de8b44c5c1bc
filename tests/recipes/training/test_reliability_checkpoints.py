"""Issue #11/#12 reliability of checkpoints: resume never starts over on damaged checkpoints, corrupt pointers and
edited manifests are caught and named, disk full stops the run cleanly, loading never runs code, batch changes on
resume are refused, an unshared run.dir is named, and eval records the checkpoint it evaluated."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat

import pytest
import torch
from recipe_helpers import tiny_resolved

from megazoo.data.fileio import file_sha256
from megazoo.parallel.checkpoint import io as ckpt_io
from megazoo.parallel.checkpoint.consolidate import read_full_state
from megazoo.parallel.checkpoint.io import (CheckpointError, CheckpointSaveError, latest_good_checkpoint,
                                            verify_checkpoint)
from megazoo.parallel.topology import Topology
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.trainer import Trainer

MARKER_CODE = "open({!r}, 'w').write('pwned')"


def _run(tmp_path, steps=4, every=2, **sections):
    res = tiny_resolved(train={"steps": steps, **sections.pop("train", {})}, run={"dir": str(tmp_path)},
                        checkpoint={"every": every, "keep": 5, **sections.pop("checkpoint", {})}, **sections)
    return res, Trainer(res, Topology.solo())


def _snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _reseal(step_dir, filename):
    """Re-record a file's size/sha256 in the manifest and the manifest's own sha256, as an attacker could."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    file = step_dir / filename
    manifest["files"][filename] = {"bytes": file.stat().st_size, "sha256": file_sha256(file)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    (step_dir / "manifest.sha256").write_text(f"{file_sha256(step_dir / 'manifest.json')}  manifest.json\n")


def test_resume_with_only_corrupt_checkpoints_refuses_and_touches_nothing(tmp_path):
    _, trainer = _run(tmp_path)
    trainer.fit()
    root = tmp_path / "checkpoints"
    for step in ("step_00000002", "step_00000004"):
        shard = root / step / "rank00000.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = _snapshot(root)
    res, resumed = _run(tmp_path, checkpoint={"resume": True})
    with pytest.raises(CheckpointError) as info:
        checkpointing.restore(resumed, report=lambda *_: None)
    message = str(info.value)
    assert "step_00000002" in message and "step_00000004" in message and message.count("sha256") == 2
    assert "use --overwrite to start over (the old run is moved aside)" in message
    assert _snapshot(root) == before


def test_resume_without_checkpoints_starts_at_zero(tmp_path):
    _, trainer = _run(tmp_path, checkpoint={"resume": True})
    assert checkpointing.restore(trainer, report=lambda *_: None) == 0


def test_non_utf8_latest_falls_back_to_a_good_checkpoint(tmp_path):
    _, trainer = _run(tmp_path)
    trainer.fit()
    root = tmp_path / "checkpoints"
    (root / "latest").write_bytes(b"\xff\xfe\x00step")
    reports = []
    assert latest_good_checkpoint(root, report=reports.append) == root / "step_00000004"
    assert any("latest" in r for r in reports)
    _, resumed = _run(tmp_path, checkpoint={"resume": True})
    assert checkpointing.restore(resumed, report=lambda *_: None) == 4


def test_edited_manifest_is_caught_and_named(tmp_path):
    _, trainer = _run(tmp_path)
    trainer.fit()
    step = tmp_path / "checkpoints" / "step_00000004"
    manifest = json.loads((step / "manifest.json").read_text())
    a, b = manifest["pieces"][0], manifest["pieces"][1]
    a["key"], b["key"] = b["key"], a["key"]  # two pieces swapped
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"manifest .*step_00000004/manifest.json is corrupt or was changed.*manifest.sha256"):
        verify_checkpoint(step)
    (step / "manifest.sha256").unlink()
    with pytest.raises(CheckpointError, match=r"step_00000004 has no manifest.sha256"):
        verify_checkpoint(step)


def test_pieces_that_do_not_fit_name_the_file(tmp_path):
    _, trainer = _run(tmp_path)
    trainer.fit()
    step = tmp_path / "checkpoints" / "step_00000004"
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["pieces"][0]["stop"] += 1  # resealed: only the assembly can notice
    (step / "manifest.json").write_text(json.dumps(manifest))
    _reseal(step, "common.json")
    with pytest.raises(CheckpointError, match=r"checkpoint file .*rank00000.pt: piece"):
        read_full_state(step)


def test_disk_full_during_save_names_it_removes_the_temp_dir_and_stops(tmp_path, monkeypatch):
    _, trainer = _run(tmp_path, steps=2, every=2)
    trainer.fit()
    root = tmp_path / "checkpoints"
    before = _snapshot(root)
    _, trainer = _run(tmp_path, steps=4, every=2)
    start = trainer.load_checkpoint(root / "step_00000002")

    def full(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointSaveError) as info:
        trainer.fit(start_step=start)  # saves at step 4: the run stops there
    monkeypatch.undo()
    message = str(info.value)
    assert "no space left on device writing" in message and "rank00000.pt" in message
    assert "needed ~" in message and "free " in message and "previous checkpoint is intact" in message
    assert not list(root.glob(".tmp-*")) and not (root / "step_00000004").exists()
    assert _snapshot(root) == before and latest_good_checkpoint(root) == root / "step_00000002"


def test_torch_iostream_error_with_a_full_disk_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_io.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 100, 0))
    text = ckpt_io._describe_write_error(RuntimeError("basic_ios::clear: iostream error"), tmp_path / "x.pt", 10)
    assert text.startswith(f"no space left on device writing {tmp_path / 'x.pt'} (needed ~10 B, free 0 B)")


def test_a_rank_file_rank0_does_not_see_is_an_unshared_filesystem_error(tmp_path, monkeypatch):
    real = ckpt_io.read_back_problem

    def verify_then_vanish(path, *args, **kwargs):  # as if the file went to a disk only that rank's host sees
        problem = real(path, *args, **kwargs)
        if path.name == "rank00000.pt":
            path.unlink()
        return problem

    monkeypatch.setattr(ckpt_io, "read_back_problem", verify_then_vanish)
    _, trainer = _run(tmp_path, steps=2, every=2)
    with pytest.raises(CheckpointSaveError, match=r"checkpoint directory .*\.tmp-step_00000002 is not shared between "
                                                  r"ranks \(rank 0 on host .* multi-node runs need a shared "
                                                  r"filesystem for run.dir"):
        trainer.fit()
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def _pickle_bomb(marker):
    class Bomb:
        def __reduce__(self):
            return (exec, (MARKER_CODE.format(str(marker)),))
    return Bomb()


def test_a_crafted_pickle_is_refused_and_never_runs(tmp_path):
    _, trainer = _run(tmp_path)
    trainer.fit()
    step = tmp_path / "checkpoints" / "step_00000004"
    marker = tmp_path / "marker"
    torch.save({"pieces": {}, "extras": {"rng": _pickle_bomb(marker)}}, step / "rank00000.pt")
    _reseal(step, "rank00000.pt")  # the manifest cannot protect against someone who can rewrite it
    _, other = _run(tmp_path / "other")
    with pytest.raises(CheckpointError, match=r"refusing to load checkpoint file .*step_00000004/rank00000.pt"):
        other.load_checkpoint(step)
    with pytest.raises(CheckpointError, match=r"refusing to load checkpoint file .*rank00000.pt"):
        read_full_state(step)
    assert not marker.exists()


def test_an_old_pickled_common_pt_is_refused_and_never_runs(tmp_path):
    _, trainer = _run(tmp_path)
    trainer.fit()
    step = tmp_path / "checkpoints" / "step_00000004"
    marker = tmp_path / "marker"
    (step / "common.json").unlink()
    (step / "manifest.sha256").unlink()
    torch.save({"step": 4, "model": _pickle_bomb(marker)}, step / "common.pt")
    manifest = json.loads((step / "manifest.json").read_text())  # as an older megazoo wrote it
    del manifest["files"]["common.json"]
    manifest["files"]["common.pt"] = {"bytes": (step / "common.pt").stat().st_size,
                                      "sha256": file_sha256(step / "common.pt")}
    (step / "manifest.json").write_text(json.dumps(manifest))
    for load in (lambda: read_full_state(step), lambda: _run(tmp_path / "o")[1].load_checkpoint(step)):
        with pytest.raises(CheckpointError, match=r"older megazoo .*common.pt.*unpickling a file can run code"):
            load()
    assert not marker.exists()


def test_the_checkpoint_holds_no_pickled_objects(tmp_path):
    _, trainer = _run(tmp_path)
    trainer.fit()
    step = tmp_path / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in step.iterdir()) == ["common.json", "manifest.json", "manifest.sha256",
                                                      "rank00000.pt"]
    common = json.loads((step / "common.json").read_text())
    assert common["step"] == 4 and common["global_batch"] == 4 and common["recipe"]["train"]["micro_batch"] == 4
    torch.load(step / "rank00000.pt", weights_only=True)  # tensors and plain containers only


@pytest.mark.parametrize("change, key", [({"micro_batch": 2, "grad_accum": 2}, "train.micro_batch = 4 in the "
                                          "checkpoint, 2 now"), ({"seq_len": 16}, "train.seq_len = 32 in the "
                                          "checkpoint, 16 now"), ({"grad_accum": 2}, "global batch")])
def test_resume_with_another_batch_is_refused(tmp_path, change, key):
    _, trainer = _run(tmp_path)
    trainer.fit()
    _, resumed = _run(tmp_path, steps=6, train=change, checkpoint={"resume": True})
    with pytest.raises(CheckpointError, match="checkpoint.allow_batch_change") as info:
        checkpointing.restore(resumed, report=lambda *_: None)
    assert key in str(info.value)


def test_a_batch_change_is_reported_when_allowed_and_free_for_fine_tuning(tmp_path):
    _, trainer = _run(tmp_path)
    trainer.fit()
    _, resumed = _run(tmp_path, steps=6, train={"micro_batch": 2},
                      checkpoint={"resume": True, "allow_batch_change": True})
    reports = []
    assert checkpointing.restore(resumed, report=reports.append) == 4
    assert any("allowed by checkpoint.allow_batch_change" in r for r in reports)
    load = {"load": str(tmp_path / "checkpoints"), "load_optimizer": False}
    _, tuned = _run(tmp_path / "tune", train={"micro_batch": 2}, checkpoint=load)
    assert checkpointing.restore(tuned, report=lambda *_: None) == 0


def test_checkpoint_files_get_the_normal_umask(tmp_path):
    old = os.umask(0o022)
    try:
        _, trainer = _run(tmp_path, steps=2, every=2)
        trainer.fit()
    finally:
        os.umask(old)
    step = tmp_path / "checkpoints" / "step_00000002"
    for path in [step, *step.iterdir(), tmp_path / "checkpoints" / "latest"]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))


def test_random_streams_saved_on_another_device_type_are_not_restored(tmp_path):
    """A CPU checkpoint resumed on a GPU must not pass a CPU generator state to cuda.set_rng_state: the streams
    are tagged with the device type and restored only on the same kind of device."""
    import torch
    from recipe_helpers import tiny_resolved

    from megazoo.parallel.topology import Topology
    from megazoo.recipes.training import checkpointing
    from megazoo.recipes.training.trainer import Trainer

    trainer = Trainer(tiny_resolved(run={"dir": str(tmp_path)}), Topology.solo())
    rng = checkpointing._rng_state(trainer)
    assert bytes(rng["device"].tolist()).decode() == "cpu"
    before = trainer.model.rng.get_state().clone()
    torch.manual_seed(123)
    trainer.model.rng.set_state(before)
    gpu_saved = {**rng, "device": torch.tensor(list(b"cuda"), dtype=torch.uint8),
                 "cpu": torch.zeros_like(rng["cpu"])}  # would corrupt the CPU stream if it were applied
    state_before = torch.get_rng_state().clone()
    checkpointing._set_rng_state(trainer, gpu_saved)
    assert torch.equal(torch.get_rng_state(), state_before)
    checkpointing._set_rng_state(trainer, rng)  # the same device type: restored
    assert torch.equal(torch.get_rng_state(), rng["cpu"])
