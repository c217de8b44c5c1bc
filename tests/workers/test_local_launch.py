"""workers/supervisor.py, the one local launcher (the torchrun command, the restart loop), and
local_launch.finish_worker (the deterministic end of a worker). `megazoo train` and `megazoo eval --tp N` run
through it end to end in test_cli.py, test_fault_tolerance.py and test_eval_cli.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megazoo.workers import supervisor as launcher
from megazoo.workers.supervisor import launch_local, torchrun_command

REPO = Path(__file__).resolve().parents[2]


def test_torchrun_command():
    assert torchrun_command(3, "megazoo.eval.cli", ["lambada", "--tp", 3]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
        "-m", "megazoo.eval.cli", "lambada", "--tp", "3"]
    with pytest.raises(ValueError, match="nproc 0"):
        torchrun_command(0, "megazoo.recipes.train")


def test_launch_local_restarts_every_worker_after_a_failure(monkeypatch, capsys):
    codes, commands = [1, 7, 0], []

    def fake_call(command):
        commands.append(command)
        return codes.pop(0)

    monkeypatch.setattr(launcher.Job, "attempt", lambda job, command: fake_call(command))
    assert launch_local(2, "megazoo.recipes.train", ["r.toml"], max_restarts=5, restart_note=" from X") == 0
    assert len(commands) == 3 and all(c == torchrun_command(2, "megazoo.recipes.train", ["r.toml"]) for c in commands)
    err = capsys.readouterr().err.splitlines()
    assert err == ["megazoo: attempt 1 failed (exit code 1); restarting all 2 workers from X (5 restart(s) left)",
                   "megazoo: attempt 2 failed (exit code 7); restarting all 2 workers from X (4 restart(s) left)"]
    codes[:] = [3, 4]
    assert launch_local(2, "m", max_restarts=1) == 4 and codes == []  # out of restarts: the last exit code


def test_launch_local_without_restarts_returns_the_first_exit_code(monkeypatch):
    monkeypatch.setattr(launcher.Job, "attempt", lambda job, command: 9)
    assert launch_local(4, "megazoo.eval.cli", ["wikitext103"]) == 9


WORKER = """
import os, sys
import torch.distributed as dist
from megazoo.workers.local import finish_worker
if sys.argv[1] == "group":
    store = dist.FileStore(sys.argv[2], 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
sys.stdout.write("unflushed output")  # os._exit skips the interpreter's flush: finish_worker must do it
finish_worker(int(sys.argv[3]))
print("never reached")
"""


@pytest.mark.parametrize("mode", ["group", "none"])
@pytest.mark.parametrize("code", [0, 2])
def test_finish_worker_flushes_tears_down_and_exits_with_the_code(tmp_path, mode, code):
    out = subprocess.run([sys.executable, "-c", WORKER, mode, str(tmp_path / "store"), str(code)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == code, out.stderr[-2000:]
    assert out.stdout == "unflushed output"


def _stop_in(job: launcher.Job, seconds: float, sig: int = 15) -> None:
    """A stop signal reaching the launcher `seconds` from now (the handler Job installs, called directly)."""
    import threading
    threading.Timer(seconds, job._on_signal, args=(sig, None)).start()


def test_a_stop_after_the_workers_saved_lets_torchrun_finish_instead_of_signalling_it(tmp_path):
    # A node whose workers stopped and saved before its own SIGTERM arrived (the other node's stop reached them
    # through the all-reduced stop flag): torchrun must end on its own (signalled, it would leave the elastic
    # agents' exit barrier and the other node's torchrun would wait there), and the job still ends as stopped.
    finished = tmp_path / "torchrun-finished"
    fake_torchrun = ("import os, time; open(os.environ['MEGAZOO_STOP_FILE'], 'w').write('15'); time.sleep(1.5); "
                     f"open({str(finished)!r}, 'w').write('done')")
    with launcher.Job(no_worker_wait_s=60) as job:
        _stop_in(job, 0.3)
        code = job.attempt([sys.executable, "-c", fake_torchrun])
        assert (code, job.stopped_by(code)) == (0, 15)
    assert finished.exists(), "torchrun was signalled although its workers had already stopped"


def test_a_stop_that_finds_no_worker_signals_torchrun_after_the_wait(tmp_path):
    # torchrun still in its rendezvous (no worker yet, nothing saved): after no_worker_wait_s the stop goes to it.
    with launcher.Job(no_worker_wait_s=0.5) as job:
        _stop_in(job, 0.2)
        code = job.attempt([sys.executable, "-c", "import time; time.sleep(60)"])
        assert (code, job.stopped_by(code)) == (128 + 15, 15)
