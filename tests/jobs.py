"""What the tests that start real jobs (`megazoo train`, torchrun, `megazoo launch`) share: a tiny recipe, and
finding and ending every process a test started (their command lines name the test's tmp folder)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

TINY_JOB = """
[model]
preset = "gpt2-tiny"
n_layer = 2
vocab_size = 300
dropout = 0.0
attn_dropout = 0.0
[parallel]
dp = {dp}
timeout_s = {timeout_s}  # a collective stuck on a dead peer errors out instead of waiting the default 10 minutes
[zero]
stage = {stage}
[train]
steps = {steps}
micro_batch = {micro_batch}
seq_len = 32
{train}
[data]
source = "synthetic"
synthetic_tokens = 20000
[checkpoint]
{checkpoint}
[logging]
progress = false
[sample]
tokens = 0
[run]
dir = "{run_dir}"
"""


def write_recipe(path: Path, run_dir: Path, *, dp: int = 2, steps: int = 3, stage: int = 2, micro_batch: int = 2,
                 timeout_s: float = 60, train: str = "", checkpoint: str = "every = 1000") -> Path:
    """A tiny synthetic-data GPT job (2 blocks, vocab 300) as a recipe file; `train` / `checkpoint` add lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TINY_JOB.format(dp=dp, steps=steps, stage=stage, micro_batch=micro_batch, timeout_s=timeout_s,
                                    train=train, checkpoint=checkpoint, run_dir=run_dir))
    return path


def processes(marker: str, kind: bytes | None = None) -> list[int]:
    """Live processes whose command line names `marker` (and the module `kind`, when given), this one excluded."""
    pids = []
    for proc_dir in Path("/proc").iterdir():
        try:
            cmd = (proc_dir / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if any(marker.encode() in part for part in cmd) and (kind is None or kind in cmd) \
                and proc_dir.name.isdigit() and int(proc_dir.name) != os.getpid():
            pids.append(int(proc_dir.name))
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] != b"Z"  # a zombie has ended


def wait_gone(pids: list[int], timeout: float = 60) -> list[int]:
    """The pids still alive after up to `timeout` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def end_processes(marker: str) -> None:
    """SIGKILL every process whose command line names `marker`, and wait until they are gone."""
    for _ in range(2):
        left = processes(marker)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_gone(left, timeout=30)
