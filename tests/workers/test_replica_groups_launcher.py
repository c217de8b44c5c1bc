"""workers/replica_groups.py, the launcher of fault-tolerant replica groups, with stand-in workers (plain processes
that follow a script, not torchrun: the restart logic is the launcher's, the training is tested in
tests/parallel/fault_tolerance/): a failed group is restarted alone (marked as restarted) while the other runs on,
and the lighthouse's death falls back to the normal restart path (a new lighthouse, every group resumed) when the
launcher owns the lighthouse, or ends the job saying so when it was given one."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from megazoo.workers.replica_groups import Lighthouse, LighthouseSettings, launch_replica_groups

pytest.importorskip("torchft")

# The stand-in worker: logs who it is, then does what the scenario says for (group, restarted, resumed).
WORKER = textwrap.dedent("""
    import os, sys, time
    log, scenario = sys.argv[1], sys.argv[2]
    group, restarted = os.environ["MEGAZOO_REPLICA_GROUP"], os.environ.get("MEGAZOO_REPLICA_RESTART", "0")
    resumed = "checkpoint.resume=true" in sys.argv
    with open(log, "a") as f:
        f.write(f"{group} {restarted} {int(resumed)} {os.environ['TORCHFT_LIGHTHOUSE']}\\n")
    if scenario == "group":  # group 1 dies once; group 0 finishes once group 1's restart is up
        if group == "1" and restarted == "0":
            sys.exit(1)
        while group == "0" and "1 1 0" not in open(log).read():
            time.sleep(0.05)
        sys.exit(0)
    if scenario == "lighthouse":  # the lighthouse is lost once (recorded; torchrun exits 1); the resumed run finishes
        if not resumed:
            from megazoo.workers.replica_groups import record_lighthouse_gone
            assert record_lighthouse_gone()
            sys.exit(1)
        sys.exit(0)
    if scenario == "dropped":  # group 1 always fails; group 0 finishes once group 1's restart is up
        if group == "1":
            sys.exit(3)
        while "1 1 0" not in open(log).read():
            time.sleep(0.05)
        sys.exit(0)
""")


def _launch(tmp_path: Path, scenario: str, **kwargs) -> tuple[int, list[list[str]]]:
    worker, log = tmp_path / "worker.py", tmp_path / "log"
    worker.write_text(WORKER)
    command = lambda nproc, module, argv: [sys.executable, str(worker), *argv]  # noqa: E731
    code = launch_replica_groups(2, 1, "unused", [str(log), scenario], command=command,
                                 resume_argv=["--set", "checkpoint.resume=true"], **kwargs)
    return code, [line.split() for line in log.read_text().splitlines()]


def test_a_failed_group_is_restarted_alone(tmp_path, capfd):
    code, starts = _launch(tmp_path, "group")
    assert code == 0
    # group 0 started once; group 1 twice, the second time marked as restarted (it heals), never resumed from disk
    assert sorted(s[:3] for s in starts) == [["0", "0", "0"], ["1", "0", "0"], ["1", "1", "0"]]
    assert len({s[3] for s in starts}) == 1  # one lighthouse throughout
    err = capfd.readouterr().err
    assert "torchft lighthouse started at http://" in err
    assert "replica group 1 failed (exit code 1); restarting it: it rejoins the quorum and heals" in err


def test_a_group_out_of_restarts_is_dropped_and_the_others_finish(tmp_path, capfd):
    code, starts = _launch(tmp_path, "dropped", max_group_restarts=1)
    assert code == 0
    assert sorted(s[:2] for s in starts) == [["0", "0"], ["1", "0"], ["1", "1"]]
    assert "replica group 1 failed (exit code 3) and is dropped: no restarts left" in capfd.readouterr().err


def test_lighthouse_death_restarts_every_group_from_its_checkpoint_with_a_new_lighthouse(tmp_path, capfd):
    code, starts = _launch(tmp_path, "lighthouse")
    assert code == 0
    first, again = [s for s in starts if s[2] == "0"], [s for s in starts if s[2] == "1"]
    assert sorted(s[0] for s in first) == sorted(s[0] for s in again) == ["0", "1"]  # every group, resumed
    assert {s[3] for s in first} != {s[3] for s in again}  # by a new lighthouse
    assert all(s[1] == "0" for s in starts)
    assert "falling back to the normal restart path: a new lighthouse at http://" in capfd.readouterr().err


def test_a_given_lighthouse_lost_ends_the_job_saying_how_to_continue(tmp_path, capfd):
    house = Lighthouse(LighthouseSettings())
    try:
        code, starts = _launch(tmp_path, "lighthouse", lighthouse=house.address)
    finally:
        house.stop()
    assert code == 1 and len(starts) == 2  # no restart: the launcher cannot bring someone else's lighthouse back
    err = capfd.readouterr().err
    assert f"the torchft lighthouse at {house.address} is gone" in err and "--resume" in err
