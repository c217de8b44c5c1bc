"""checkpoint.async_save (parallel/checkpoint/async_save.py): the files are byte-identical to a sync save's; a
process killed while the background write runs resumes exactly from the previous good checkpoint; a failed or
corrupt background write raises at the next save or the end of the run, on every rank; one save in flight."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import run_distributed
from recipe_helpers import tiny_resolved
from checkpoint_helpers import FlippingWriter

from megazoo.parallel.checkpoint import io as ckpt_io
from megazoo.parallel.checkpoint.io import (CheckpointReadBackError, CheckpointSaveError, latest_good_checkpoint,
                                            verify_checkpoint)
from megazoo.parallel.topology import Topology
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
SMALL = {"n_layer": 1, "d_model": 32, "n_head": 2}


def _resolved(run_dir, steps=4, every=2, dp=1, **checkpoint):
    return tiny_resolved(model=SMALL, parallel={"dp": dp}, train={"steps": steps, "micro_batch": 4 // dp,
                                                                   "seq_len": 16},
                         run={"dir": str(run_dir)}, checkpoint={"every": every, "keep": 3, **checkpoint})


def _with_checkpoint(res, **changes):
    recipe = res.recipe
    checkpoint = dataclasses.replace(recipe.checkpoint, **{k: v for k, v in changes.items() if k != "dir"})
    run = dataclasses.replace(recipe.run, dir=changes.get("dir", recipe.run.dir))
    return dataclasses.replace(res, recipe=dataclasses.replace(recipe, checkpoint=checkpoint, run=run))


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _same_state_both_ways(root: str):
    """One trainer's state after 2 steps saved sync (root/sync), then async (root/async, published by wait())."""
    rank = dist.get_rank()
    res = _resolved(f"{root}/sync", dp=2)
    trainer = Trainer(res, Topology.build(2))
    for step in range(2):
        trainer.train_step(step)
    sync = trainer.save_checkpoint(2)
    trainer.res = _with_checkpoint(res, async_save=True, dir=f"{root}/async")
    promised = trainer.save_checkpoint(2)
    assert checkpointing.async_saver(trainer).in_flight()
    published = checkpointing.async_saver(trainer).wait()
    return rank, str(sync), str(promised), str(published)


def test_async_files_are_byte_identical_to_sync(tmp_path):
    for rank, sync, promised, published in run_distributed(_same_state_both_ways, 2, str(tmp_path)):
        assert promised == published == str(tmp_path / "async" / "checkpoints" / "step_00000002")
    sync_files, async_files = _files(Path(sync)), _files(Path(published))
    assert sorted(sync_files) == ["common.json", "manifest.json", "manifest.sha256", "rank00000.pt", "rank00001.pt"]
    for name in ("rank00000.pt", "rank00001.pt"):  # every rank's pieces and extras: the same bytes
        assert async_files[name] == sync_files[name], name
    # common.json records the recipe, which differs in exactly the two keys changed here
    common = {kind: json.loads(files["common.json"]) for kind, files in (("sync", sync_files), ("async", async_files))}
    assert common["async"]["recipe"]["checkpoint"].pop("async_save") is True
    assert common["sync"]["recipe"]["checkpoint"].pop("async_save") is False
    for c in common.values():
        c["recipe"]["run"].pop("dir")
    assert common["async"] == common["sync"]
    manifests = {kind: json.loads(files["manifest.json"]) for kind, files in (("sync", sync_files),
                                                                                ("async", async_files))}
    for m in manifests.values():
        m["files"].pop("common.json")
    assert manifests["async"] == manifests["sync"]  # the same pieces, sizes and sha256 of the rank files
    verify_checkpoint(published)
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text() == "step_00000002"


KILLED_RUN = """
import sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)  # as the test process (tests/conftest.py): the resumed weights are compared bit for bit
sys.path.insert(0, {tests!r})
from recipe_helpers import tiny_resolved
from megazoo.parallel.checkpoint import io as ckpt_io
from megazoo.parallel.checkpoint.readback import HashingWriter
from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

class StallingWriter(HashingWriter):  # the background write of step 4 stops half-way through its rank file
    def write(self, data):
        if ".tmp-step_00000004" in getattr(self.file, "name", "") and len(memoryview(data)) > 64:
            n = super().write(bytes(memoryview(data)[: len(memoryview(data)) // 2]))
            self.file.flush()
            Path({marker!r}).write_text("writing")
            time.sleep(3600)
        return super().write(data)

ckpt_io.HashingWriter = StallingWriter
res = tiny_resolved(model={small!r}, train={{"steps": 6, "micro_batch": 4, "seq_len": 16}},
                    run={{"dir": {run_dir!r}}}, checkpoint={{"every": 2, "keep": 3, "async_save": True}})
Trainer(res, Topology.solo()).fit()
"""


def test_kill_during_background_write_resumes_from_previous_checkpoint(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "writing"
    script = KILLED_RUN.format(tests=str(REPO / "tests"), marker=str(marker), small=SMALL, run_dir=str(run_dir))
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    # the reference, a run never killed, trained while the child starts
    straight = Trainer(_resolved(tmp_path / "straight", steps=6), Topology.solo())
    full = straight.fit()
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, f"the run ended (rc {child.returncode}) before the stalled write"
            assert time.monotonic() < deadline, "the background write of step 4 never started"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)  # mid-file: rank00000.pt of step 4 is half written
    finally:
        child.kill()
        child.wait()
    root = run_dir / "checkpoints"
    assert (root / ".tmp-step_00000004" / "rank00000.pt").is_file()  # the interrupted write's debris
    assert latest_good_checkpoint(root, report=lambda *_: None) == root / "step_00000002"
    assert (root / "latest").read_text() == "step_00000002"
    verify_checkpoint(root / "step_00000002")  # nothing already saved is lost
    # resume (async again) from the previous checkpoint: the same losses and weights as a run never killed
    res = _resolved(run_dir, steps=6, resume=True, async_save=True)
    resumed = Trainer(res, Topology.solo())
    start = checkpointing.restore(resumed, report=lambda *_: None)
    assert start == 2
    tail = resumed.fit(start_step=start)
    assert tail.losses == full.losses[2:]
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(a[k].equal(b[k]) for k in a)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004", "step_00000006"]


def _failing_write(root: str, fail_step: int, steps: int):
    """Rank 1's background write of `fail_step` fails; the run goes on until the next save or its end."""
    trainer = Trainer(_resolved(root, steps=steps, dp=2, async_save=True), Topology.build(2))
    saver = checkpointing.async_saver(trainer)

    def fail(step):
        if step == fail_step and dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
    saver.before_write = fail
    try:
        trainer.fit()
    except CheckpointSaveError as err:
        return str(err)
    return None


@pytest.mark.parametrize("fail_step, steps", [(2, 4), (4, 4)], ids=["at_next_save", "at_end_of_run"])
def test_failed_background_write_raises_on_every_rank(tmp_path, fail_step, steps):
    for message in run_distributed(_failing_write, 2, str(tmp_path), fail_step, steps):
        assert message is not None
        assert f"saving checkpoint step {fail_step} under" in message and "No space left on device" in message
        assert "rank 1" in message and "previous checkpoint is intact" in message
    root = tmp_path / "checkpoints"
    assert not (root / f".tmp-step_{fail_step:08d}").exists() and not (root / f"step_{fail_step:08d}").exists()
    if fail_step == 4:  # the earlier checkpoint stays the latest good one
        assert latest_good_checkpoint(root, report=lambda *_: None) == root / "step_00000002"


def test_corrupt_background_write_is_caught_by_verify_on_save(tmp_path, monkeypatch):
    trainer = Trainer(_resolved(tmp_path, steps=2, every=1, async_save=True), Topology.solo())
    trainer.train_step(0)
    trainer.save_checkpoint(1)
    trainer.train_step(1)
    checkpointing.wait_for_save(trainer)  # step 1's writer must not meet the flipping writer (a race CI once lost)
    monkeypatch.setattr(ckpt_io, "HashingWriter", FlippingWriter)
    trainer.save_checkpoint(2)  # returns: the corruption is found by the background re-read
    with pytest.raises(CheckpointReadBackError, match="did not read back as written"):
        checkpointing.wait_for_save(trainer)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_00000001" and (root / "bad-step_00000002").is_dir()


def test_stop_and_exception_wait_for_the_write_in_flight(tmp_path):
    """A stop request (SIGTERM) saves and fit returns only once that save is published; an exception after an
    async save waits for this rank's writer (no collective) so the checkpoint is still published."""
    stopped = Trainer(_resolved(tmp_path / "stop", steps=4, every=0, async_save=True), Topology.solo())
    result = stopped.fit(stop_requested=lambda: True)
    root = tmp_path / "stop" / "checkpoints"
    assert result.stopped_at == 1 and not checkpointing.async_saver(stopped).in_flight()
    assert (root / "latest").read_text() == "step_00000001"
    verify_checkpoint(root / "step_00000001")

    failing = Trainer(_resolved(tmp_path / "crash", steps=4, every=1, async_save=True), Topology.solo())
    real_step = failing.train_step

    def train_step(step, **kwargs):
        if step == 1:
            raise RuntimeError("a rank failed")
        return real_step(step, **kwargs)
    failing.train_step = train_step
    with pytest.raises(RuntimeError, match="a rank failed"):
        failing.fit()
    root = tmp_path / "crash" / "checkpoints"
    assert (root / "latest").read_text() == "step_00000001"
    verify_checkpoint(root / "step_00000001")
