"""Measuring ranks: fresh forked gloo processes with a memory guard (recipes/reproduce/zero_bench.py, behind
`megazoo reproduce zero-scale` and benchmarks/zero.py, and benchmarks/zero3_construction.py).

Beside workers/local.py's run_distributed (tests: any exception is a failure) because a measurement expects some
attempts to fail: the one that does not fit must end as a result ("out of memory", "memory guard") the caller
can walk a ladder with, not as a crash or as the machine swapping.

Every configuration runs in fresh forked processes, because ru_maxrss is a process high-water mark. A forked
rank starts with its parent's resident pages (torch imported: the "idle rank" row). The parent kills every rank
when /proc/meminfo's MemAvailable falls under a floor, and each rank caps its address space (RLIMIT_AS), so an
attempt that does not fit fails cleanly instead of swapping or calling the OOM killer.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from megazoo.parallel.topology import init_distributed

GiB = 1 << 30


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def use_mmap_for_large_allocations(threshold: int = 1 << 20) -> None:
    """glibc serves allocations under its (dynamic, up to 32 MB) mmap threshold from the heap, and a heap
    fragmented by ZeRO-3's gather/free churn keeps freed blocks resident: RSS then measures the allocator, not
    the model (gpt2-117m ZeRO-3: 3.3 GB peak vs 2.3 GB with this). Fixing the threshold returns every large
    buffer to the OS when it is freed. Applied alike to every configuration."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def _rank_main(rank, world, workdir, fn, args, as_bytes, mmap_large):
    torch.set_num_threads(1)  # ranks share the machine's cores
    if mmap_large:
        use_mmap_for_large_allocations()
    try:
        if as_bytes:  # cap the address space this rank may add: allocation fails before the machine runs out
            limit = _vm_size() + as_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        store = dist.FileStore(os.path.join(workdir, "store"), world)
        init_distributed(rank, world, store, device="cpu", timeout_s=1800)
        outcome = {"result": fn(*args)}
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        oom = isinstance(err, MemoryError) or "allocate" in str(err)
        outcome = {"error": ("out of memory: " if oom else "") + traceback.format_exc(limit=4)[-1500:]}
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    if "error" not in outcome:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # torch 2.13 + gloo may abort at interpreter exit: leave deterministically


def launch(fn, world: int, *args, timeout_s: float = 1800, floor_bytes: int = 2 * GiB, as_bytes: int = 0,
           mmap_large: bool = True):
    """Run fn(*args) on `world` fresh forked gloo ranks. Returns (per-rank results, None) or (None, why)."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="megazoo-bench-") as workdir:
        procs = [ctx.Process(target=_rank_main, args=(r, world, workdir, fn, args, as_bytes,
                                                                   mmap_large)) for r in range(world)]
        for p in procs:
            p.start()
        start, why = time.time(), None
        files = [os.path.join(workdir, f"rank{r}.json") for r in range(world)]
        while any(p.is_alive() for p in procs) and why is None:
            time.sleep(0.2)
            errors = [r for r, f in enumerate(files) if os.path.exists(f) and "error" in open(f).read(200)]
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and not os.path.exists(files[r])]
            if errors:
                time.sleep(0.5)
                why = json.load(open(files[errors[0]]))["error"].strip().splitlines()[-1][:200]
                why = f"rank {errors[0]}: {why}"
            elif dead:
                why = f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}; killed: out of memory?)"
            elif mem_available() < floor_bytes:
                why = f"memory guard: MemAvailable fell below {floor_bytes / GiB:.1f} GiB"
            elif time.time() - start > timeout_s:
                why = f"timeout after {timeout_s:.0f}s"
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        if why is None:
            outcomes = [json.load(open(f)) if os.path.exists(f) else {"error": "no result"} for f in files]
            bad = [o["error"] for o in outcomes if "error" in o]
            why = bad[0].strip().splitlines()[-1] if bad else None
        return (None, why) if why else ([o["result"] for o in outcomes], None)
