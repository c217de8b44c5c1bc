"""The local launcher: everything that starts N processes on this machine and ends them cleanly.

- `run_distributed(fn, N, ...)` (tests and benchmarks): run a function on N gloo ranks on this machine. Each rank
  is a forked process (fast on CPU) with one intra-op thread. It initialises the default process group through
  a FileStore, runs `fn(*args)`, writes its return value (or its traceback) to a file and ends with
  `finish_worker`: the parent judges the files the ranks wrote, never exit codes, and never retries.
- `torchrun_command(N, module, argv)` / `launch_local(N, module, argv, max_restarts=...)` (the `megazoo train`
  and `megazoo eval --tp N` commands): `python -m torch.distributed.run --standalone` with N local workers
  running `python -m module argv...`, each attempt a fresh torchrun.
- `finish_worker(code)`: the deterministic end of a worker (barrier, destroy the group, flush, os._exit), since
  torch 2.13 + gloo may abort at interpreter exit after all work is done.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from megazoo.parallel.topology import init_distributed

DEFAULT_TIMEOUT_S = 300.0


def _rank_main(rank: int, world_size: int, workdir: str, fn: Callable, args: tuple, kwargs: dict) -> None:
    torch.set_num_threads(1)
    outcome: dict[str, Any]
    try:
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        init_distributed(rank, world_size, store, device="cpu", timeout_s=DEFAULT_TIMEOUT_S)
        outcome = {"result": fn(*args, **kwargs)}
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        outcome = {"error": traceback.format_exc()}
    torch.save(outcome, os.path.join(workdir, f"rank{rank}.pt"))
    finish_worker(1 if "error" in outcome else 0)  # the parent reads the file, not this exit code


def finish_worker(code: int = 0) -> NoReturn:
    """End this worker process deterministically with exit status `code`: wait at a barrier for the other ranks
    (only when `code` is 0: a failed rank must not wait for ranks that may never come), destroy the default
    process group, flush stdout/stderr and leave with os._exit, skipping interpreter teardown (where torch 2.13
    + gloo may abort after all work is done). Without a process group it only flushes and exits.

    If the barrier or the teardown itself fails (another rank died), the traceback is printed and the exit status
    is 1 (or `code`, when that is already non-zero): the same status an uncaught exception would give.
    """
    try:
        if dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported, then the exit below still happens
        traceback.print_exc()
        code = code or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_distributed(fn: Callable, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` ranks; return the per-rank results, rank order."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="megazoo-dist-") as workdir:
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, workdir, fn, args, kwargs))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for r in range(world_size):
            path = os.path.join(workdir, f"rank{r}.pt")
            outcomes.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    errors = [f"--- rank {r} ---\n{o['error']}" for r, o in enumerate(outcomes) if o and "error" in o]
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    missing = [r for r, o in enumerate(outcomes) if o is None]
    if missing or hung:
        raise RuntimeError(f"ranks {missing} wrote no result (hung: {hung}) within {timeout_s:.0f}s")
    return [o["result"] for o in outcomes]


def torchrun_command(nproc: int, module: str, argv: Sequence[str] = ()) -> list[str]:
    """The command that runs `python -m module *argv` on `nproc` local workers under torchrun (this
    interpreter, a standalone rendezvous on this machine; each worker reads RANK/WORLD_SIZE from torchrun)."""
    if nproc < 1:
        raise ValueError(f"nproc {nproc} is invalid: it must be a positive integer")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *map(str, argv)]


def launch_local(nproc: int, module: str, argv: Sequence[str] = (), *, max_restarts: int = 0,
                 restart_note: str = "") -> int:
    """Run `torchrun_command(nproc, module, argv)` and return its exit status; after a failure start it again,
    every worker, up to `max_restarts` times (a message on stderr names the attempt; `restart_note` adds what
    the restarted job will do). Each attempt is a fresh torchrun with a fresh rendezvous: torchrun's own
    --max-restarts reuses the rendezvous, and with torch 2.13 + gloo the restarted ranks intermittently failed
    to reconnect ("connectFullMesh ... Connection refused")."""
    command = torchrun_command(nproc, module, argv)
    for attempt in range(max_restarts + 1):
        code = subprocess.call(command)
        if code == 0 or attempt == max_restarts:
            return code
        print(f"megazoo: attempt {attempt + 1} failed (exit code {code}); restarting all {nproc} workers"
              f"{restart_note} ({max_restarts - attempt} restart(s) left)", file=sys.stderr, flush=True)
    return code
