"""The one local multi-process harness (tests and benchmarks): run a function on N gloo ranks on this machine.

Each rank is a forked process (fast on CPU) with one intra-op thread. It initialises the default process group
through a FileStore, runs `fn(*args)`, writes its return value (or its traceback) to a file, waits at a barrier,
destroys the group and leaves with os._exit(0): the parent judges the files the ranks wrote, never exit codes
(torch 2.13 + gloo may abort at interpreter exit after all work is done), and never retries.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable

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
    try:
        if "error" not in outcome and dist.is_initialized():
            dist.barrier()
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


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
