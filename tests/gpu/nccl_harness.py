"""N ranks on this machine's GPUs, one GPU each, through NCCL: workers/local.py's harness, spawned.

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

from typing import Callable

from megazoo.workers.local import DEFAULT_TIMEOUT_S, run_distributed


def run_on_gpus(fn: Callable, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` spawned ranks (rank r on GPU r); return the results, rank order."""
    return run_distributed(fn, world_size, *args, timeout_s=timeout_s, start_method="spawn", device=None, **kwargs)
