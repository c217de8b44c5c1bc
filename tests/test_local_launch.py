"""parallel/launcher.py, the one local launcher (the torchrun command, the restart loop), and
local_launch.finish_worker (the deterministic end of a worker). `megazoo train` and `megazoo eval --tp N` run
through it end to end in test_cli.py, test_fault_tolerance.py and test_eval_cli.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megazoo.parallel import launcher
from megazoo.parallel.launcher import launch_local, torchrun_command

REPO = Path(__file__).resolve().parents[1]


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
from megazoo.parallel.local_launch import finish_worker
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
