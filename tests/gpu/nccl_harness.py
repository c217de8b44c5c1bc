"""N ranks on this machine's GPUs, one GPU each, through NCCL: the GPU twin of parallel/local_launch.py.

    results = run_on_gpus(fn, 2, *args, timeout_s=300, **kwargs)   # [fn's return value on rank 0, rank 1]

Same contract as `run_distributed` (the CPU harness), with the differences CUDA forces:
  * ranks are *spawned*, never forked: a process that forks after CUDA was initialised (pytest's, as soon as a
    `cuda` test ran) hands its children a CUDA context they cannot use. Spawn starts a fresh interpreter, so
    `fn` and its arguments must be picklable: a module-level function of a test module, not a lambda.
  * rank r runs on GPU r: `init_distributed(rank, world, store, local_rank=rank)` selects cuda:r with
    set_device before the NCCL group exists (without CUDA it falls back to the CPU and gloo, which is how the
    harness itself is tested on a CPU machine).
  * results come back on the CPU (tensors are moved before they are written), so the parent never needs a GPU
    to read them.
The parent judges the files the ranks wrote (result or traceback), never exit codes, never retries; a rank that
hangs past `timeout_s` (every collective has the same timeout) is killed and named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from megazoo.parallel.local_launch import finish_worker
from megazoo.parallel.topology import init_distributed

DEFAULT_TIMEOUT_S = 300.0


def to_cpu(value: Any) -> Any:
    """`value` with every tensor (in dicts, lists, tuples) detached and moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def _rank_main(rank: int, world_size: int, workdir: str, timeout_s: float, fn: Callable, args: tuple,
               kwargs: dict) -> None:
    outcome: dict[str, Any]
    try:
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        init_distributed(rank, world_size, store, local_rank=rank, timeout_s=timeout_s)
        outcome = {"result": to_cpu(fn(*args, **kwargs))}
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        outcome = {"error": traceback.format_exc()}
    torch.save(outcome, os.path.join(workdir, f"rank{rank}.pt"))
    finish_worker(1 if "error" in outcome else 0)  # barrier, destroy the group, os._exit


def run_on_gpus(fn: Callable, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` spawned ranks (rank r on GPU r); return the results, rank order."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megazoo-nccl-") as workdir:
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, workdir, timeout_s, fn, args, kwargs))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s + 60)  # spawn start-up (importing torch) on top of the collective timeout
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
        raise RuntimeError("distributed GPU test failed:\n" + "\n".join(errors))
    missing = [r for r, o in enumerate(outcomes) if o is None]
    if missing or hung:
        raise RuntimeError(f"ranks {missing} wrote no result (hung: {hung}) within {timeout_s:.0f}s")
    return [o["result"] for o in outcomes]
