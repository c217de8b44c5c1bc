"""Which rank hung, and where: torch's flight recorder, dumped by every rank when a collective times out.

torch (2.13) keeps, when the environment variable TORCH_FR_BUFFER_SIZE is > 0 at process-group creation, a ring
of each rank's most recent collectives on every process group, for every backend, gloo included: op, group,
per-group sequence number, shapes, dtypes and state, read with torch._C._distributed_c10d._dump_fr_trace_json.
(On NCCL the same recorder is what the watchdog dumps.) megazoo only switches it on (`enable_flight_recorder`,
called by init_distributed before the groups exist: the variable is written for torch's C++, never read here),
writes each rank's ring to a folder when its collective timed out (`dump_ring`) and turns the rings that arrived
into one line (`diagnose`): "rank 0 in all_reduce #4 on default_pg ([4], Float); rank 1 in all_gather #4 ...".

Nothing here communicates: a rank that timed out cannot count on its peers' collectives, only on the shared
run directory (which checkpoints need anyway).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megazoo.data.fileio import atomic_write_bytes

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
KEYS = ("profiling_name", "collective_seq_id", "process_group", "input_sizes", "input_dtypes", "state", "retired",
        "is_p2p", "time_created_ns")


def enable_flight_recorder(entries: int) -> None:
    """Record each rank's last `entries` collectives on every process group created from now on."""
    os.environ[BUFFER_ENV] = str(entries)


def recent_collectives(limit: int = 16) -> list[dict]:
    """This rank's last `limit` recorded collectives, oldest first (empty when the recorder is off)."""
    import torch._C._distributed_c10d as c10d

    try:
        entries = json.loads(c10d._dump_fr_trace_json()).get("entries", [])
    except (AttributeError, RuntimeError, ValueError):
        return []
    entries.sort(key=lambda e: e.get("time_created_ns", 0))
    return [{k: e.get(k) for k in KEYS} for e in entries[-limit:]]


def ring_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"collectives_rank{rank:05d}.json"


def dump_ring(folder: str | Path, rank: int) -> Path:
    path = ring_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({"rank": rank, "collectives": recent_collectives()}, indent=1).encode())
    return path


def read_rings(folder: str | Path, world_size: int, wait_s: float = 5.0) -> dict[int, list[dict]]:
    """The rings the ranks dumped, waiting up to `wait_s` for the ones not there yet (peers time out later)."""
    deadline, rings = time.monotonic() + wait_s, {}
    while True:
        for rank in range(world_size):
            path = ring_path(folder, rank)
            if rank not in rings and path.is_file():
                try:
                    rings[rank] = json.loads(path.read_text())["collectives"]
                except (OSError, ValueError, KeyError):
                    pass  # being replaced: read it on the next pass
        if len(rings) == world_size or time.monotonic() >= deadline:
            return rings
        time.sleep(0.1)


def _call(entry: dict) -> str:
    op = str(entry.get("profiling_name") or "?").split(":")[-1]
    group = entry.get("process_group") or ["?", "?"]
    sizes = entry.get("input_sizes") or []
    shape = ", ".join(str(list(s)) for s in sizes) or "-"
    dtypes = ", ".join(entry.get("input_dtypes") or []) or "-"
    return f"{op} #{entry.get('collective_seq_id')} on {group[-1]} ({shape}, {dtypes})"


def diagnose(rings: dict[int, list[dict]], world_size: int) -> str:
    """One line: the last collective each rank entered; ranks whose ring did not arrive are named too."""
    calls = [f"rank {rank} in {_call(ring[-1])}" if ring else f"rank {rank}: no collective recorded"
             for rank, ring in sorted(rings.items())]
    missing = [r for r in range(world_size) if r not in rings]
    if missing:
        calls.append(f"no record from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
    return "; ".join(calls)
