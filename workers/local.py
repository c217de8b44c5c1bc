"""N ranks of a function on this machine, and the clean end of any worker (workers/supervisor.py starts jobs).

- `run_distributed(fn, N, ...)` (tests and benchmarks): run a function on N ranks on this machine. Each rank is
  a forked process (fast on CPU; `start_method="spawn"` for GPU tests) with one intra-op thread. It initialises
  the default process group through a FileStore, runs `fn(*args)`, writes its return value (or its traceback)
  to a file and ends with `finish_worker`: the parent judges the files the ranks wrote, never exit codes, and
  never retries.
- `finish_worker(code)`: the deterministic end of a worker (barrier, destroy the group, flush, os._exit), since
  torch 2.13 + gloo may abort at interpreter exit after all work is done.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import traceback
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from megazoo.parallel.topology import init_distributed

DEFAULT_TIMEOUT_S = 300.0


def _to_cpu(value: Any) -> Any:
    """`value` with every tensor (in dicts, lists, tuples) detached and on the CPU: the parent reads no GPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (dict, list, tuple)):
        items = [(k, _to_cpu(v)) for k, v in (value.items() if isinstance(value, dict) else enumerate(value))]
        return dict(items) if isinstance(value, dict) else type(value)(v for _, v in items)
    return value


def _rank_main(rank: int, world_size: int, workdir: str, timeout_s: float, device: str | None, fn: Callable,
               args: tuple, kwargs: dict, check_collectives: bool = False, flight_recorder: int = 0) -> None:
    torch.set_num_threads(1)
    outcome: dict[str, Any]
    try:
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        init_distributed(rank, world_size, store, local_rank=rank, device=device, timeout_s=timeout_s,
                         check_collectives=check_collectives, flight_recorder=flight_recorder)
        outcome = {"result": _to_cpu(fn(*args, **kwargs))}
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


def run_distributed(fn: Callable, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S,
                    start_method: str = "fork", device: str | None = "cpu", check_collectives: bool = False,
                    flight_recorder: int = 0, **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` ranks; return the per-rank results (on the CPU), rank order.

    CPU tests fork gloo ranks (fast). GPU tests pass start_method="spawn" (a process that forked after CUDA
    was initialised hands its children a context they cannot use; spawned `fn` must be picklable) and
    device=None: rank r then runs on GPU r with NCCL (local_device). Every collective times out after
    `timeout_s`; a rank still running then is killed and named. `check_collectives`: a mismatched collective
    fails at once on every rank of the group, naming both calls (parallel/collective_check.py); `flight_recorder`:
    each rank's last that many collectives are recorded (parallel/flight_recorder.py)."""
    ctx = mp.get_context(start_method)
    startup_s = 60.0 if start_method == "spawn" else 0.0  # a fresh interpreter imports torch first
    with tempfile.TemporaryDirectory(prefix="megazoo-dist-") as workdir:
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, workdir, timeout_s, device, fn, args, kwargs,
                                                             check_collectives, flight_recorder))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s + startup_s)
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


def tp_worker(args: Any, solo: Callable[[Any], int], work: Callable[[Any, Any], None]) -> int:
    """The torchrun worker of a tensor-parallel command (eval, eval harness, generate): alone (WORLD_SIZE 1) it
    runs `solo(args)` with tp = ep = 1; under torchrun it joins the group, runs `work(args, Topology(tp=world / ep,
    ep=ep))` and ends through finish_worker, exit 2 with the rank named when the input is bad (FileNotFoundError,
    ValueError)."""
    from megazoo.parallel.topology import Topology

    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world_size == 1:
        args.tp = 1
        if hasattr(args, "ep"):
            args.ep = 1
        return solo(args)
    # --ep E (an MoE model's eval, eval harness, generate): E x tp workers, the routed experts split over E ranks
    # (the ep group, laid out as dp); every one takes part in every forward, as the command arranges
    # (eval/scoring.gpt_forward splits a scoring batch's rows over them; decoding runs every row on each)
    ep = getattr(args, "ep", 1)
    # This worker's GPU is its node-local rank's (torchrun's LOCAL_RANK), not GPU 0 for every rank.
    init_distributed(rank, world_size, init_method="env://", local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    code = 0
    try:
        work(args, Topology.build(dp=ep, tp=world_size // ep, ep=ep))
    except (FileNotFoundError, ValueError) as error:
        print(f"megazoo: error (rank {rank}): {error}", file=sys.stderr)
        code = 2
    finish_worker(code)  # barrier (when all went well), destroy the group, flush, os._exit(code)
