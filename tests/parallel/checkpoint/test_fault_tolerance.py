"""A rank killed mid-run (SIGKILL) under --max-restarts, and preemption (SIGTERM), through the real command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from jobs import processes, write_recipe

from megazoo.parallel.checkpoint.consolidate import read_full_state

REPO = Path(__file__).resolve().parents[3]


def _recipe(tmp_path: Path, name: str, steps: int = 10) -> Path:
    return write_recipe(tmp_path / f"{name}.toml", tmp_path / name, steps=steps, micro_batch=4,
                        train='lr = 3e-3\nwarmup_steps = 2\nprecision = "fp32"', checkpoint="every = 5\nkeep = 3")


def _megazoo(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megazoo.recipes.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for_steps(metrics: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach {n} steps (exit code {proc.poll()})")


def _worker_pids(recipe: Path) -> list[int]:
    """The training workers of this run (python -m megazoo.recipes.train RECIPE), not torchrun (it names both)."""
    return sorted(set(processes(str(recipe), b"megazoo.recipes.train"))
                  - set(processes(str(recipe), b"torch.distributed.run")))


def test_killed_rank_restarts_from_the_last_checkpoint_and_ends_identical(tmp_path):
    reference = _megazoo("train", str(_recipe(tmp_path, "reference", steps=40)))
    out, err = reference.communicate(timeout=400)
    assert reference.returncode == 0, err[-3000:]
    recipe = _recipe(tmp_path, "faulty", steps=40)
    job = _megazoo("train", str(recipe), "--max-restarts", "1")
    _wait_for_steps(tmp_path / "faulty" / "metrics.jsonl", 12, job)  # past the checkpoint at step 10
    victims = _worker_pids(recipe)
    assert len(victims) == 2
    os.kill(victims[1], signal.SIGKILL)
    out, err = job.communicate(timeout=400)
    assert job.returncode == 0, err[-3000:]
    assert "attempt 1 failed" in err and "resumed from" in out  # the job went on from a checkpoint
    _, want = read_full_state(tmp_path / "reference" / "checkpoints")
    _, got = read_full_state(tmp_path / "faulty" / "checkpoints")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)  # bit-identical end
    steps = [json.loads(line)["step"] for line in (tmp_path / "faulty" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(40))  # one clean history: the lines past the resumed checkpoint were dropped
    assert (tmp_path / "faulty" / "metrics.jsonl.discarded").is_file()  # ... and kept aside


def test_sigterm_saves_a_checkpoint_and_resume_finishes(tmp_path):
    recipe = _recipe(tmp_path, "preempted", steps=400)
    run_dir = tmp_path / "preempted"
    proc = _megazoo("train", str(recipe), "--set", "parallel.dp=1", "--set", "zero.stage=0",
                    "--set", "checkpoint.every=1000")
    metrics = run_dir / "metrics.jsonl"
    _wait_for_steps(metrics, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]  # 128 + SIGTERM: stopped, not finished
    assert "stopped by SIGTERM after step" in out and "Traceback" not in err
    stopped = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert 3 <= stopped < 400
    assert (run_dir / "checkpoints" / f"step_{stopped:08d}" / "manifest.json").is_file()
    resumed = subprocess.run([sys.executable, "-m", "megazoo.recipes.cli", "train", str(recipe), "--set", "parallel.dp=1",
                              "--set", "zero.stage=0", "--set", "train.steps=" + str(stopped + 3), "--resume"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from" in resumed.stdout and f"at step {stopped}" in resumed.stdout
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-3:] == [stopped, stopped + 1, stopped + 2]
