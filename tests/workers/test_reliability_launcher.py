"""The launcher owns its job (issue 11): signals to `megazoo train` alone reach every worker and never orphan
one, one job per run.dir, a stop by signal is not restarted and exits 128 + signal, a used run.dir is not
silently written over, and metrics.jsonl stays one clean history across restarts. Through the real command."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import end_processes, processes, wait_gone, write_recipe

from megazoo.recipes.training.metrics import MetricsLog
from megazoo.recipes.training.run_dir import RunDirLock

REPO = Path(__file__).resolve().parents[2]


def _recipe(tmp_path: Path, name: str, *, dp: int = 2, steps: int = 400, every: int = 1000) -> Path:
    return write_recipe(tmp_path / f"{name}.toml", tmp_path / name, dp=dp, steps=steps, stage=0,
                        train='precision = "fp32"', checkpoint=f"every = {every}")


def _megazoo(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megazoo.recipes.cli", "train", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(*args: str, module: str = "megazoo.recipes.cli", timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _why(err: str) -> str:
    """The lines of a failed job's stderr that say why (torchrun's failure summary left out)."""
    lines = [line for line in err.splitlines() if "Error" in line or "megazoo:" in line or "File " in line]
    return "\n".join(lines[-60:])


def _steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def _wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if len(_steps(run_dir)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach {n} steps (exit code {proc.poll()})")


def _workers(recipe: Path) -> list[int]:
    """The training workers (python -m megazoo.recipes.train RECIPE), not torchrun (whose command names it too)."""
    return sorted(set(processes(str(recipe), b"megazoo.recipes.train")) - set(_torchrun(recipe)))


def _torchrun(recipe: Path) -> list[int]:
    return processes(str(recipe), b"torch.distributed.run")


@pytest.fixture(autouse=True)
def no_process_left(tmp_path):
    """Whatever a test asserts, every process it started (named by the test's folder) is gone afterwards."""
    yield
    end_processes(str(tmp_path))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_alone_stops_every_worker_with_a_checkpoint(tmp_path, sig):
    recipe = _recipe(tmp_path, "run")
    run_dir = tmp_path / "run"
    job = _megazoo(str(recipe), "--max-restarts", "2")
    try:
        _wait_for_steps(run_dir, 3, job)
        workers = _workers(recipe)
        assert len(workers) == 2
        # One job per run.dir: a second one fails before starting anything, naming the holder.
        second = _run("train", str(recipe), "--resume", timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"pid {job.pid} on host {socket.gethostname()}" in second.stderr
        os.kill(job.pid, sig)  # the launcher only, as `kill PID`, docker stop or Kubernetes do
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 128 + sig, _why(err)  # 143 for SIGTERM: a stop, not restarted
    assert "Traceback" not in err and "attempt 1 failed" not in err, err[-3000:]
    assert not wait_gone(workers), "workers outlived their launcher"
    stopped = int(out.split(f"stopped by {sig.name} after step ")[1].split(";")[0])
    assert (run_dir / "checkpoints" / f"step_{stopped:08d}" / "manifest.json").is_file()
    assert _steps(run_dir) == list(range(stopped))


def test_sigkill_to_the_launcher_takes_torchrun_and_every_worker_along(tmp_path):
    recipe = _recipe(tmp_path, "run")
    job = _megazoo(str(recipe))
    _wait_for_steps(tmp_path / "run", 2, job)
    doomed = _workers(recipe) + _torchrun(recipe)
    assert len(doomed) == 3
    job.kill()
    job.communicate(timeout=60)
    assert not wait_gone(doomed), "torchrun or workers outlived a SIGKILLed launcher"


def test_sigkill_to_torchrun_takes_the_workers_along_and_the_restart_resumes_cleanly(tmp_path):
    recipe = _recipe(tmp_path, "run", steps=12, every=5)
    run_dir = tmp_path / "run"
    job = _megazoo(str(recipe), "--max-restarts", "1")
    _wait_for_steps(run_dir, 7, job)  # past the checkpoint at step 5
    workers, torchrun = _workers(recipe), _torchrun(recipe)
    assert len(workers) == 2 and len(torchrun) == 1
    os.kill(torchrun[0], signal.SIGKILL)
    assert not wait_gone(workers), "workers outlived a SIGKILLed torchrun"
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, _why(err)
    assert "attempt 1 failed (exit code 137)" in err and "at step 5" in out
    assert _steps(run_dir) == list(range(12))  # one clean history: the lines past step 5 were dropped
    discarded = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl.discarded").read_text().splitlines()]
    assert discarded and min(discarded) == 5


def test_a_held_run_dir_is_refused_by_the_launcher_and_by_a_lone_worker(tmp_path):
    recipe = _recipe(tmp_path, "run", dp=1)
    with RunDirLock.acquire(tmp_path / "run"):
        for module, args in (("megazoo.recipes.cli", ("train", str(recipe))), ("megazoo.recipes.train", (str(recipe),))):
            out = _run(*args, module=module, timeout=120)
            assert out.returncode == 2, out.stderr[-2000:]
            assert f"pid {os.getpid()} on host {socket.gethostname()}" in out.stderr and "Traceback" not in out.stderr
    assert not _steps(tmp_path / "run")


def test_a_fresh_run_into_a_used_run_dir_is_refused_and_overwrite_moves_it_aside(tmp_path):
    recipe = _recipe(tmp_path, "run", dp=1, steps=2)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000005").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000005" / "manifest.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    out = _run("train", str(recipe), timeout=120)
    assert out.returncode == 2 and "--resume" in out.stderr and "--overwrite" in out.stderr, out.stderr[-2000:]
    assert "step_00000005" in out.stderr and (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    out = _run("train", str(recipe), "--overwrite")
    assert out.returncode == 0, out.stderr[-3000:]
    old = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(old) == 1 and old[0].name in out.stderr
    assert (old[0] / "checkpoints" / "step_00000005" / "manifest.json").is_file()
    assert (old[0] / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert _steps(run_dir) == [0, 1] and (run_dir / "checkpoints" / "step_00000002").is_dir()


def test_negative_max_restarts_is_refused_before_start(tmp_path):
    recipe = _recipe(tmp_path, "run", dp=1)
    out = _run("train", str(recipe), "--max-restarts", "-1", timeout=120)
    assert out.returncode == 2 and "--max-restarts" in out.stderr and "0 (no restarts" in out.stderr
    assert not (tmp_path / "run").exists()


def test_metrics_log_starts_at_the_resumed_step_keeping_what_it_drops(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2, 3, 2, 3)) + '{"step": 4, "lo')
    log = MetricsLog(tmp_path, enabled=True)
    messages = []
    log.start_at(2, report=messages.append)
    log.write({"step": 2})
    log.close()
    assert _steps(tmp_path) == [0, 1, 2]
    dropped = (tmp_path / "metrics.jsonl.discarded").read_text().splitlines()
    assert len(dropped) == 5 and dropped[-1] == '{"step": 4, "lo' and "moved 5" in messages[0]
    log = MetricsLog(tmp_path, enabled=True)
    log.start_at(3, report=messages.append)  # nothing past step 3: the file is left as it is
    assert len(messages) == 1 and _steps(tmp_path) == [0, 1, 2]
