"""Hangs that name the rank, on a signal (issue 32): a 2-process training job through the launcher, rank 1 stuck
(it sleeps while loading step 2's batches, so rank 0 waits in a collective without end). SIGUSR1 to the launcher:
every rank writes its ring of recent collectives to run.dir/.progress and rank 0 prints which rank waits in which
call. SIGTERM twice (stop, then kill): the launcher has the rings written once more before it kills the job, and no
process outlives it. Plus the diagnosis line from hand-made rings (sequence numbers, group names, NCCL states)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from jobs import end_processes, processes, write_recipe

from megazoo.parallel.flight_recorder import diagnose

STUCK_WORKER = """
import sys, time
from pathlib import Path
from megazoo.recipes import train
from megazoo.recipes.training import trainer

original = trainer.Trainer._batches
def stuck(self, samples, micro, *rest):
    if self.topo.rank == 1 and self.progress is not None and self.progress.step == 2:
        Path(sys.argv[1]).with_name("stuck").write_text("")
        time.sleep(600)  # longer than the test: only a kill ends it
    return original(self, samples, micro, *rest)
trainer.Trainer._batches = stuck
sys.exit(train.main())
"""

LAUNCHER = """
import sys
from megazoo.workers.supervisor import launch_local
sys.exit(launch_local(2, "stuck_worker", [sys.argv[1]], env={{"PYTHONPATH": {path!r}}}, ring_dump=True))
"""


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_sigusr1_names_the_waiting_rank_and_the_one_behind_and_the_kill_leaves_nothing(tmp_path):
    recipe = write_recipe(tmp_path / "recipe.toml", tmp_path / "run", steps=50, timeout_s=300,
                          train="", checkpoint="every = 1000")
    recipe.write_text(recipe.read_text().replace("timeout_s = 300", "timeout_s = 300\nflight_recorder = 64"))
    (tmp_path / "stuck_worker.py").write_text(STUCK_WORKER)
    err_path = tmp_path / "launcher.err"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    with open(err_path, "w") as err:
        job = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(path=str(tmp_path)), str(recipe)],
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        _wait_for(lambda: (tmp_path / "stuck").exists() or job.poll() is not None, 120, "rank 1 to get stuck")
        assert job.poll() is None, err_path.read_text()[-3000:]
        time.sleep(2.0)  # rank 0 reaches its next collective and waits there
        os.kill(job.pid, signal.SIGUSR1)
        _wait_for(lambda: "SIGUSR1: last collectives" in err_path.read_text(), 30, "the diagnosis line")
        line = next(x for x in err_path.read_text().splitlines() if "SIGUSR1: last collectives" in x)
        waiting = re.search(r"rank 0 waits in (\w+) #(\d+) on dp \(", line)
        behind = re.search(r"rank 1 in (\w+) #(\d+) on dp \(.*\), behind \(its peers are at #(\d+)\)", line)
        print(line)
        assert waiting and behind, line
        assert int(behind.group(2)) < int(waiting.group(2)) == int(behind.group(3))
        rings = [json.loads((tmp_path / "run" / ".progress" / f"collectives_rank{r:05d}.json").read_text())
                 for r in range(2)]
        assert [ring["rank"] for ring in rings] == [0, 1] and all(ring["collectives"] for ring in rings)
        assert job.poll() is None  # SIGUSR1 is not a stop: the job still waits
        before = rings[0]["dumped_at"]
        os.kill(job.pid, signal.SIGTERM)  # stop: rank 1 never finishes its step ...
        time.sleep(1.0)
        os.kill(job.pid, signal.SIGTERM)  # ... so the second one kills, after one more dump
        assert job.wait(timeout=60) != 0
        err_text = err_path.read_text()
        assert "megazoo: killing the job" in err_text
        assert err_text.count("SIGUSR1: last collectives") == 2, err_text[-3000:]
        again = json.loads((tmp_path / "run" / ".progress" / "collectives_rank00000.json").read_text())
        assert again["dumped_at"] > before
        assert processes(str(tmp_path)) == []  # nothing outlives the job
    finally:
        if job.poll() is None:
            job.kill()
        end_processes(str(tmp_path))


def _entry(op: str, seq: int, group: str = "0", state: str = "scheduled") -> dict:
    return {"profiling_name": f"nccl:{op}", "collective_seq_id": seq, "process_group": [group, "undefined"],
            "input_sizes": [[4]], "input_dtypes": ["Float"], "state": state}


def test_the_line_says_who_waits_who_is_behind_and_names_groups_as_the_topology_does():
    dp = {"0": "dp", "3": "tp"}
    rings = {0: {"collectives": [_entry("all_reduce", 811), _entry("all_gather", 812)], "groups": dp},
             1: {"collectives": [_entry("reduce_scatter", 811)], "groups": dp},
             2: {"collectives": [_entry("all_gather", 812)], "groups": dp},
             3: {"collectives": [_entry("all_reduce", 5, group="3", state="completed")], "groups": dp}}
    assert diagnose(rings, 5) == (
        "rank 0 waits in all_gather #812 on dp ([4], Float); "
        "rank 1 in reduce_scatter #811 on dp ([4], Float), behind (its peers are at #812); "
        "rank 2 waits in all_gather #812 on dp ([4], Float); rank 3 last in all_reduce #5 on tp ([4], Float), "
        "completed; no record from rank 4")
    same = {r: {"collectives": [_entry("all_reduce", 4)], "groups": {}} for r in range(2)}
    assert diagnose(same, 2) == "rank 0 in all_reduce #4 on undefined ([4], Float); rank 1 in all_reduce #4 on " \
                                "undefined ([4], Float)"
    assert "rank 0: no collective recorded" in diagnose({0: {"collectives": []}}, 1)
