"""Issue 26's operator defects, each refused or reported in one line with nothing lost: a run.dir on a read-only
folder (named, before any process starts), a full disk while the data cache is written (no partial entry left)
a plain file named like a step folder under checkpoints/ (refused before start, never counted as a run), and
`--resume` at 2 processes over only damaged checkpoints (one line from the launcher, exit 2, no worker started,
nothing changed), and a stopped preprocess (Ctrl-C / SIGTERM: one line, 130 / 143, no temporary file; a SIGKILLed
one's temporary file is removed by the next run), and a worker killed by SIGKILL (the survivor names the dead
rank in one line instead of gloo's traceback; the launcher exits non-zero and no process outlives the job)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from jobs import end_processes, processes, wait_gone, write_recipe
from recipe_helpers import tiny_resolved

import megazoo.data.token_dataset as token_dataset
from megazoo.data.token_dataset import DataCacheError, build_stdlib_corpus
from megazoo.recipes import cli, train
from megazoo.parallel.topology import Topology
from megazoo.recipes.training.run_dir import previous_run
from megazoo.recipes.training.trainer import Trainer


def _mount_tmpfs(folder: Path, options: str) -> bool:
    """A tmpfs on `folder` (root only): a real read-only or full file system, not a patched call."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


@pytest.fixture
def read_only_folder(tmp_path):
    folder = tmp_path / "ro"
    mounted = _mount_tmpfs(folder, "ro,size=64k")
    if not mounted:
        folder.chmod(0o555)  # not root: the permission bits refuse (root would write through them)
    yield folder
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)
    else:
        folder.chmod(0o755)


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """A folder whose file system fills up while the data cache is written: a 64 KiB tmpfs as root, else a
    writer that writes part of the array and then fails with ENOSPC, as a full disk does."""
    folder = tmp_path / "disk"
    mounted = _mount_tmpfs(folder, "size=64k")
    if not mounted:
        def save_until_full(path, array, *args, **kwargs):
            Path(path).write_bytes(array.tobytes()[:100])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        monkeypatch.setattr(token_dataset.np, "save", save_until_full)
    yield folder
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


def _no_process_may_start(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")
    monkeypatch.setattr(cli, "launch_local", refuse)


@pytest.mark.parametrize("where", ["run.dir inside it", "run.dir is it"])
def test_run_dir_on_a_read_only_folder_is_named_before_any_process_starts(tmp_path, read_only_folder, where,
                                                                         monkeypatch, capsys):
    run_dir = read_only_folder / "run" if where == "run.dir inside it" else read_only_folder
    recipe = write_recipe(tmp_path / "job.toml", run_dir, dp=2)
    _no_process_may_start(monkeypatch)
    assert cli.main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("megazoo: error: run.dir = ") and str(run_dir) in err and "cannot be written" in err
    assert ("Read-only file system" in err or "Permission denied" in err), err


def test_a_full_disk_while_writing_the_data_cache_is_one_line_and_leaves_no_partial_entry(full_disk, capsys):
    with pytest.raises(DataCacheError) as info:
        build_stdlib_corpus(full_disk / "data_cache", vocab_size=300, max_bytes=200_000, val_fraction=0.1, seed=0)
    message = str(info.value)
    assert "No space left on device" in message and str(full_disk / "data_cache") in message
    assert "nothing was kept" in message
    assert list((full_disk / "data_cache").iterdir()) == []  # no entry, no hidden staging folder


def test_the_training_job_reports_a_full_data_cache_in_one_line(tmp_path, full_disk, capsys):
    recipe = tmp_path / "job.toml"
    recipe.write_text(write_recipe(tmp_path / "base.toml", full_disk / "run", dp=1).read_text()
                      .replace('source = "synthetic"', 'source = "stdlib"\nvocab_size = 300\nmax_bytes = 200000'))
    assert train.main([str(recipe)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megazoo: error")]
    assert len(err) == 1 and "cannot write the data cache entry" in err[0] and "No space left on device" in err[0]
    assert not any(p.name.startswith(".") and "tmp" in p.name for p in (full_disk / "run" / "data_cache").iterdir())


@pytest.mark.parametrize("flag", [[], ["--resume"]], ids=["fresh", "resume"])
def test_a_plain_file_named_like_a_step_folder_is_refused_before_start_and_kept(tmp_path, flag, monkeypatch,
                                                                               capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    stray = run_dir / "checkpoints" / "step_00000001"
    stray.write_text("my notes\n")
    (run_dir / "checkpoints" / "step_notes.txt").write_text("not a step name: left alone\n")
    recipe = write_recipe(tmp_path / "job.toml", run_dir, dp=2, checkpoint="every = 1")
    assert previous_run(run_dir) == []  # files are no checkpoints: not "a run" to resume or to move aside
    _no_process_may_start(monkeypatch)
    assert cli.main(["train", str(recipe), *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(stray) in err and "not a folder" in err and "move or remove" in err
    assert stray.read_text() == "my notes\n"


def test_a_lone_worker_refuses_the_stray_step_file_too(tmp_path, capsys):
    """Started without the launcher (torchrun RECIPE, or python -m megazoo.recipes.train)."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000002").write_bytes(b"")
    recipe = write_recipe(tmp_path / "job.toml", run_dir, dp=1, checkpoint="every = 1")
    assert train.main([str(recipe), "--set", "checkpoint.resume=true"]) == 2
    assert "step_00000002" in capsys.readouterr().err
    assert np.array_equal(sorted(p.name for p in (run_dir / "checkpoints").iterdir()), ["step_00000002"])


def test_resume_at_two_processes_over_only_damaged_checkpoints_is_one_line_and_starts_nothing(tmp_path, monkeypatch,
                                                                                             capsys):
    run_dir = tmp_path / "run"
    res = tiny_resolved(train={"steps": 2, "micro_batch": 2}, run={"dir": str(run_dir)},
                        checkpoint={"every": 1, "keep": 5})
    Trainer(res, Topology.solo()).fit()  # a checkpoint's layout does not matter to resume: any layout loads
    root = run_dir / "checkpoints"
    for shard in root.glob("step_*/rank*.pt"):
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    recipe = write_recipe(tmp_path / "job.toml", run_dir, dp=2, checkpoint="every = 1")
    _no_process_may_start(monkeypatch)  # before the fix: each of the 2 workers printed it, then torchrun's summary
    assert cli.main(["train", str(recipe), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("megazoo: error: --resume: no good checkpoint under "), err
    assert "2 damaged" in err and "step_00000002" in err and "--overwrite" in err
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"} == \
        {p: b for p, b in before.items() if p.name != ".lock"}


def _big_jsonl(path: Path) -> Path:
    line = json.dumps({"text": "The quick brown fox jumps over the lazy dog, again and again. " * 40}) + "\n"
    path.write_text(line * 6000)  # ~15 MB: encoding takes seconds, so the signal lands mid-run
    return path


def _preprocess(tmp_path, data_dir, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megazoo.data.indexed.preprocess", "--input",
                             str(_big_jsonl(tmp_path / "in.jsonl")), "--tokenizer", str(data_dir / "gpt2_bpe"),
                             "--output-prefix", str(tmp_path / "out" / "wiki"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_a_stopped_preprocess_says_one_line_and_leaves_no_temporary_file(tmp_path, data_dir, sig):
    (tmp_path / "out").mkdir()
    proc = _preprocess(tmp_path, data_dir, "--workers", "2")
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "out").glob(".wiki.bin.*.tmp")):  # the writer has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        # Ctrl-C reaches the terminal's whole process group (the pool's workers too); SIGTERM the command alone
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("preprocess:")]  # no bar
    assert lines == [f"megazoo preprocess: stopped by {'Ctrl-C' if sig == signal.SIGINT else 'SIGTERM'}; no output "
                     "and no temporary file were left"], err
    assert list((tmp_path / "out").iterdir()) == []


def test_a_temporary_file_left_by_a_killed_preprocess_is_removed_by_the_next_run(tmp_path, data_dir):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = out / f".wiki.bin.{int(dead.stdout)}-0123abcd.tmp"  # as AtomicFile names it, for a pid now gone
    stale.write_bytes(b"\0" * 1000)
    live = out / f".wiki.bin.{os.getpid()}-0123abcd.tmp"  # a running writer's file is left alone
    live.write_bytes(b"")
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    done = subprocess.run([sys.executable, "-m", "megazoo.data.indexed.preprocess", "--input", str(tmp_path / "in.jsonl"),
                           "--tokenizer", str(data_dir / "gpt2_bpe"), "--output-prefix", str(out / "wiki"),
                           "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"megazoo preprocess: removed {stale}, left by an interrupted run" in done.stderr
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([live.name, "wiki.bin", "wiki.idx"])


def test_a_worker_killed_by_sigkill_is_named_by_the_survivor_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "job.toml", run_dir, dp=2, steps=400, stage=0, train='precision = "fp32"')
    launcher = subprocess.Popen([sys.executable, "-m", "megazoo.recipes.cli", "train", str(recipe)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)
        torchrun = processes(str(recipe), b"torch.distributed.run")
        workers = sorted(set(processes(str(recipe), b"megazoo.recipes.train")) - set(torchrun))
        ranks = {int(dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0")
                          if "=" in v)["RANK"]): pid for pid in workers}
        os.kill(ranks[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=300)
        assert launcher.returncode != 0
        assert not wait_gone(processes(str(recipe)), timeout=30)  # nothing outlives the job
    finally:
        end_processes(str(tmp_path))
    assert "[rank0]:" not in err and "This is typically caused by" not in err, err[-3000:]  # gloo's traceback
    named = [line for line in err.splitlines() if line.startswith("megazoo: error (rank 0): rank 1 died")]
    assert len(named) == 1, err[-3000:]
    assert f"pid {ranks[1]}" in named[0] and "rank 0 lost it during step" in named[0]
