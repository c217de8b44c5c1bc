"""A stalled rank ends the job with a message naming the operation and the ranks that did not arrive (issue 11,
item 11): every rank records where it is (recipes/training/progress.py); the rank whose collective times out explains."""

from __future__ import annotations

import re

import torch.distributed as dist
from jobs import write_recipe

from megazoo.recipes.training.progress import Progress, is_collective_timeout


def test_the_timed_out_rank_names_the_operation_and_the_missing_ranks(tmp_path):
    ranks = [Progress(tmp_path, r, 3) for r in range(3)]
    for p in ranks:
        p.enter(4, "loading batches")
        p.enter(4, "forward/backward")
    ranks[0].enter(4, "optimizer step")  # rank 0 waits in the optimizer's all-reduce ...
    ranks[2].enter(4, "optimizer step")  # ... with rank 2; rank 1 is still in its backward
    message = ranks[0].explain(RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete"))
    assert "rank 0 timed out in a collective during step 4, optimizer step" in message
    assert "ranks that did not arrive: 1\n" in message
    assert "rank 1 (host " in message and "is in step 4, forward/backward, for " in message
    assert "rank 2 (" not in message


def test_when_everyone_arrived_the_collective_itself_is_blamed(tmp_path):
    ranks = [Progress(tmp_path, r, 2) for r in range(2)]
    for p in ranks:
        p.enter(0, "checkpoint save")
    assert "every rank reached this operation" in ranks[1].explain(RuntimeError("Timed out"))


def test_a_rank_that_never_started_is_named(tmp_path):
    p = Progress(tmp_path, 0, 2)
    p.enter(0, "loading batches")
    assert "rank 1 (host ?, pid ?) is in no record (not started?)" in p.explain(RuntimeError("timeout"))


def test_which_errors_are_collective_timeouts():
    assert is_collective_timeout(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 20000ms"))
    assert is_collective_timeout(dist.DistBackendError("NCCL watchdog: Timeout(ms)=600000"))
    assert not is_collective_timeout(RuntimeError("CUDA out of memory"))
    assert not is_collective_timeout(ValueError("timed out"))  # not from a collective


# Rank 1 stalls while loading the batches of step 2 (a hung filesystem, say); rank 0 goes on into step 2's
# backward, whose reduce-scatter waits for rank 1 until parallel.timeout_s.
STALL_WORKER = """
import os, sys, time
from megazoo.recipes import train
from megazoo.recipes.training import trainer

original = trainer.Trainer._batches
def stalling(self, samples, micro, *rest):
    if self.topo.rank == 1 and self.progress is not None and self.progress.step == 2:
        time.sleep(20)  # past parallel.timeout_s; then it finds its peer gone and fails too
    return original(self, samples, micro, *rest)
trainer.Trainer._batches = stalling
sys.exit(train.main())
"""


def test_a_stalled_rank_is_named_with_what_it_was_doing(tmp_path):
    import subprocess
    import sys

    write_recipe(tmp_path / "recipe.toml", tmp_path / "run", steps=6, timeout_s=6)
    (tmp_path / "worker.py").write_text(STALL_WORKER)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--standalone", str(tmp_path / "worker.py"), str(tmp_path / "recipe.toml")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0
    # Rank 0 waits for rank 1's gradients (ZeRO-2 reduce-scatter, finished in the optimizer step).
    assert "megazoo: error (rank 0): rank 0 timed out in a collective during step 2, optimizer step" \
        in out.stderr, out.stderr[-3000:]
    assert "ranks that did not arrive: 1" in out.stderr
    assert "rank 1 (host " in out.stderr and "is in step 2, loading batches" in out.stderr
    # parallel.flight_recorder is on by default: the rings are written and every rank's last collective named
    # (rank 1 sleeps in Python, outside any collective: its ring comes only on a signal, test_ring_dump_signal.py)
    assert "Last collectives (rings in " in out.stderr, out.stderr[-3000:]
    assert re.search(r"rank 0 (waits )?in \w+ #\d+ on dp \(", out.stderr), out.stderr[-3000:]


# Rank 1 hangs inside the checkpoint save of step 2 (a stuck write: the issue stopped it with SIGSTOP once
# .tmp-step_00000002 appeared), rank 0 writes its files and waits in the save's all_gather until timeout_s.
SAVE_STALL_WORKER = """
import sys, time
from megazoo.parallel.checkpoint import io
from megazoo.recipes import train

original = io._write_rank
def stuck(tmp, rank, *rest):
    if rank == 1:
        time.sleep(12)  # past parallel.timeout_s and the ring wait after it: rank 0 ends the job first
    return original(tmp, rank, *rest)
io._write_rank = stuck
sys.exit(train.main())
"""


def test_a_rank_hung_inside_a_checkpoint_save_is_named(tmp_path):
    """The save records its parts (writing, gathering) as operations of its own: rank 0, waiting in the gather,
    names rank 1 as not arrived and still writing, instead of "every rank reached this operation"."""
    import subprocess
    import sys

    from jobs import end_processes

    write_recipe(tmp_path / "recipe.toml", tmp_path / "run", steps=3, timeout_s=4, checkpoint="every = 2")
    (tmp_path / "worker.py").write_text(SAVE_STALL_WORKER)
    try:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--standalone", str(tmp_path / "worker.py"), str(tmp_path / "recipe.toml")],
                             cwd=tmp_path, capture_output=True, text=True, timeout=240)
    finally:
        end_processes(str(tmp_path))
    assert out.returncode != 0
    assert "rank 0 timed out in a collective during step 2, checkpoint save, gathering every rank's status " \
           "(all_gather)" in out.stderr, out.stderr[-3000:]
    assert "ranks that did not arrive: 1" in out.stderr and "every rank reached" not in out.stderr
    assert "rank 1 (host " in out.stderr and "is in step 2, checkpoint save, writing this rank's files" in out.stderr
