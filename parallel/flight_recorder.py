"""Which rank hung, and where: torch's flight recorder, dumped by every rank when a collective times out.

torch (2.13) keeps, when the environment variable TORCH_FR_BUFFER_SIZE is > 0 at process-group creation, a ring
of each rank's most recent collectives on every process group, for every backend, gloo included: op, group,
per-group sequence number, shapes, dtypes and state, read with torch._C._distributed_c10d._dump_fr_trace_json.
(On NCCL the same recorder is what the watchdog dumps.) megazoo only switches it on (`enable_flight_recorder`,
called by init_distributed before the groups exist: the variable is written for torch's C++, never read here),
writes each rank's ring to a folder when its collective timed out (`dump_ring`) or on SIGUSR1 (`RingDumpOnSignal`)
and turns the rings that arrived into one line (`diagnose`): "rank 0 waits in all_gather #4 on dp ([4], Float);
rank 1 in all_reduce #3 on dp ([4], Float), behind (its peers are at #4)". Groups are named by what the Topology
calls them (dp, tp, pp, cp, ...; `group_labels`), torch's own name otherwise.

Nothing here communicates: a rank that timed out (or is stuck) cannot count on its peers' collectives, only on
the shared run directory (which checkpoints need anyway).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from megazoo.data.fileio import atomic_write_bytes

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
FRESH_S = 5.0  # a ring dumped this long before rank 0 saw the signal is still this signal's (peers see it first)
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


def group_labels(topo) -> dict[str, str]:
    """torch's process-group name -> what this rank's Topology `topo` (not imported: topology.py imports this
    module) calls the group ("dp", "tp", ...). A dp group that
    spans the whole world is torch's default group itself; a group that plays two parts keeps its first name."""
    labels: dict[str, str] = {}
    for label in ("dp", "tp", "pp", "cp", "dp_cp", "embedding", "dp_intra", "dp_inter"):
        group = getattr(topo, f"{label}_group", None)
        if group is not None:
            labels.setdefault(str(group.group_name), label)
    return labels


def dump_ring(folder: str | Path, rank: int, groups: dict[str, str] | None = None) -> Path:
    path = ring_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "dumped_at": time.time(), "groups": groups or {}, "collectives": recent_collectives()}
    atomic_write_bytes(path, json.dumps(record, indent=1).encode())
    return path


def read_rings(folder: str | Path, world_size: int, wait_s: float = 5.0,
               newer_than: float | None = None) -> dict[int, dict]:
    """The ring records the ranks dumped (rank -> {"collectives": [...], "groups": {...}, ...}), waiting up to
    `wait_s` for the ones not there yet (peers time out, or handle the signal, a little later); with
    `newer_than` (a time.time()), older dumps count as not there yet."""
    deadline, rings = time.monotonic() + wait_s, {}
    while True:
        for rank in range(world_size):
            path = ring_path(folder, rank)
            if rank not in rings and path.is_file():
                try:
                    record = json.loads(path.read_text())
                    if newer_than is None or record.get("dumped_at", 0.0) >= newer_than:
                        rings[rank] = {"groups": {}, **record, "collectives": list(record["collectives"])}
                except (OSError, ValueError, KeyError):
                    pass  # being replaced: read it on the next pass
        if len(rings) == world_size or time.monotonic() >= deadline:
            return rings
        time.sleep(0.1)


def _group(entry: dict, labels: dict[str, str]) -> str:
    name, desc = (list(entry.get("process_group") or ["?", "?"]) + ["?"])[:2]
    return labels.get(str(name), str(desc))


def _call(entry: dict, labels: dict[str, str]) -> str:
    op = str(entry.get("profiling_name") or "?").split(":")[-1]
    sizes = entry.get("input_sizes") or []
    shape = ", ".join(str(list(s)) for s in sizes) or "-"
    dtypes = ", ".join(entry.get("input_dtypes") or []) or "-"
    return f"{op} #{entry.get('collective_seq_id')} on {_group(entry, labels)} ({shape}, {dtypes})"


def diagnose(rings: dict[int, dict], world_size: int) -> str:
    """One line: the last collective each rank entered; on a group where the ranks' last sequence numbers differ,
    the ranks at the highest wait in it and the others are behind. (gloo never marks a collective completed in
    the ring, NCCL does: a completed last call is said so.) Ranks whose ring did not arrive are named too."""
    last = {rank: (record["collectives"][-1] if record["collectives"] else None) for rank, record in rings.items()}
    labels = {rank: record.get("groups", {}) for rank, record in rings.items()}
    furthest: dict[str, int] = {}  # group label -> highest sequence number any rank's last call reached there
    for rank, entry in last.items():
        if entry is not None:
            group = _group(entry, labels[rank])
            furthest[group] = max(furthest.get(group, -1), int(entry.get("collective_seq_id") or 0))
    spread = {g for g in furthest if any(e is not None and _group(e, labels[r]) == g and
                                         int(e.get("collective_seq_id") or 0) < furthest[g] for r, e in last.items())}
    calls = []
    for rank, entry in sorted(last.items()):
        if entry is None:
            calls.append(f"rank {rank}: no collective recorded")
            continue
        group, call = _group(entry, labels[rank]), _call(entry, labels[rank])
        if entry.get("state") == "completed":
            calls.append(f"rank {rank} last in {call}, completed")
        elif group in spread and int(entry.get("collective_seq_id") or 0) < furthest[group]:
            calls.append(f"rank {rank} in {call}, behind (its peers are at #{furthest[group]})")
        else:
            calls.append(f"rank {rank} {'waits ' if group in spread else ''}in {call}")
    missing = [r for r in range(world_size) if r not in rings]
    if missing:
        calls.append(f"no record from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
    return "; ".join(calls)


class RingDumpOnSignal:
    """While open: SIGUSR1 makes this rank write its ring to `folder` (rank 0 then waits up to `wait_s` for its
    peers' rings and prints the diagnosis line on stderr), however stuck the main thread is.

    A rank stuck in a collective is blocked in C++ with the GIL released, where a Python signal handler would
    never run (CPython runs handlers in the main thread, between bytecodes). So the handler only lets CPython's C
    handler write the signal number to a wakeup pipe (signal.set_wakeup_fd, whichever thread the kernel chose),
    and a daemon thread blocked on that pipe does the dump. `recorder` False (parallel.flight_recorder = 0):
    SIGUSR1 is still caught (not the default action, which kills) and says there is no ring."""

    def __init__(self, folder: str | Path, rank: int, world_size: int, groups: dict[str, str], *,
                 recorder: bool = True, wait_s: float = 10.0) -> None:
        self.folder, self.rank, self.world_size, self.groups = Path(folder), rank, world_size, groups
        self.recorder, self.wait_s = recorder, wait_s
        self._previous: tuple | None = None

    def __enter__(self) -> RingDumpOnSignal:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers belong to the main thread: a caller off it gets no dump on signal
        read, write = os.pipe()
        os.set_blocking(write, False)  # set_wakeup_fd's requirement: a full pipe drops a byte, never blocks
        previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        previous_handler = signal.signal(signal.SIGUSR1, lambda *_: None)  # the work happens in the thread
        self._previous = (previous_fd, previous_handler, read, write)
        threading.Thread(target=self._watch, args=(read,), name="megazoo-ring-dump", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is None:
            return
        previous_fd, previous_handler, read, write = self._previous
        signal.signal(signal.SIGUSR1, previous_handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(write)  # the thread's read returns b"" and it ends
        self._previous = None

    def _watch(self, read: int) -> None:
        while data := os.read(read, 64):
            if signal.SIGUSR1 in data:  # the pipe carries every caught signal's number; only SIGUSR1 dumps
                try:
                    self.dump()
                except Exception as error:  # a failed dump must not take the (maybe healthy) job down
                    print(f"megazoo: rank {self.rank}: SIGUSR1: ring dump failed: {error!r}", file=sys.stderr,
                          flush=True)
        os.close(read)

    def dump(self) -> str | None:
        """Write this rank's ring; on rank 0 also print (and return) the diagnosis of the rings that arrive."""
        if not self.recorder:
            if self.rank == 0:
                print("megazoo: SIGUSR1: no collectives recorded (parallel.flight_recorder = 0)", file=sys.stderr,
                      flush=True)
            return None
        asked = time.time()
        dump_ring(self.folder, self.rank, self.groups)
        if self.rank != 0:
            return None
        rings = read_rings(self.folder, self.world_size, self.wait_s, newer_than=asked - FRESH_S)
        line = f"megazoo: SIGUSR1: last collectives (rings in {self.folder}): {diagnose(rings, self.world_size)}"
        print(line, file=sys.stderr, flush=True)
        return line
