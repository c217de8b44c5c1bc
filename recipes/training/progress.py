"""Where each rank is in the training loop, so a stalled job says which operation hung and who was missing.

A collective that times out only says "Timed out waiting 600000ms for recv". Every rank therefore records, at
each operation of the loop that runs collectives (loading batches, forward/backward, optimizer step, metrics,
checkpoint save, evaluation), a small JSON file `run.dir/.progress/rankNNNNN.json` with its step, the operation
and a sequence number. All ranks run the same sequence of operations, so when rank r's collective times out, the
ranks whose sequence number is below r's have not reached the operation r is waiting in: `explain()` names them,
what they are doing instead, and since when. (Multi-node runs keep run.dir on a shared filesystem, which
checkpoints need anyway.)
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import torch.distributed as dist


def is_collective_timeout(error: BaseException) -> bool:
    """A collective that gave up waiting (gloo: "Timed out ...", NCCL: a DistBackendError / watchdog timeout)."""
    if isinstance(error, getattr(dist, "DistBackendError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


class Progress:
    def __init__(self, run_dir: str | Path, rank: int, world_size: int):
        self.folder = Path(run_dir) / ".progress"
        self.rank, self.world_size = rank, world_size
        self.step, self.operation, self.seq = None, "starting", 0
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, rank: int) -> Path:
        return self.folder / f"rank{rank:05d}.json"

    def enter(self, step: int | None, operation: str) -> None:
        """Record that this rank starts `operation` of `step` (a rename, so readers never see half a file)."""
        self.step, self.operation, self.seq = step, operation, self.seq + 1
        record = {"rank": self.rank, "step": step, "operation": operation, "seq": self.seq,
                  "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        tmp = self._path(self.rank).with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self._path(self.rank))

    def others(self) -> list[dict]:
        records = []
        for rank in range(self.world_size):
            try:
                records.append(json.loads(self._path(rank).read_text()))
            except (OSError, ValueError):
                records.append({"rank": rank, "step": None, "operation": "no record (not started?)", "seq": 0,
                                "time": None})
        return records

    def explain(self, error: BaseException) -> str:
        """One message: the operation this rank was in when its collective gave up, and the ranks that had not
        arrived there (with what they were doing)."""
        where = f"step {self.step}, {self.operation}" if self.step is not None else self.operation
        missing = [r for r in self.others() if r["rank"] != self.rank and r["seq"] < self.seq]
        lines = [f"rank {self.rank} timed out in a collective during {where} "
                 f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"]
        if missing:
            now = time.time()
            lines.append(f"ranks that did not arrive: {', '.join(str(r['rank']) for r in missing)}")
            for r in missing:
                since = f", for {now - r['time']:.0f} s" if r.get("time") else ""
                at = f"step {r['step']}, " if r.get("step") is not None else ""
                lines.append(f"  rank {r['rank']} (host {r.get('host', '?')}, pid {r.get('pid', '?')}) is in "
                             f"{at}{r['operation']}{since}")
        else:
            lines.append("every rank reached this operation: the collective itself stalled (a network or "
                         "device problem), or a rank died inside it")
        return "\n".join(lines)

    def dead_peers(self, wait_s: float = 5.0) -> list[dict]:
        """The other ranks on this host whose process is gone (or a zombie), per their progress records; waits
        up to `wait_s` for one, since a peer's socket closes a moment before its launcher reaps it. Ranks on
        other hosts cannot be checked from here (their own output says what happened)."""
        host, deadline = socket.gethostname(), time.monotonic() + wait_s
        while True:
            dead = [r for r in self.others() if r["rank"] != self.rank and r.get("host") == host
                    and isinstance(r.get("pid"), int) and not _alive(r["pid"])]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.2)

    def explain_dead(self, error: BaseException, dead: list[dict]) -> str:
        """One line: which rank(s) died and where this rank lost them (instead of the transport's traceback)."""
        where = f"step {self.step}, {self.operation}" if self.step is not None else self.operation
        who = "; ".join(f"rank {r['rank']} (pid {r['pid']}, last seen in "
                        f"{'step ' + str(r['step']) + ', ' if r.get('step') is not None else ''}{r['operation']})"
                        for r in dead)
        # the transport's first sentence, without its source location ("[.../pair.cc:537] Read error ...")
        first = re.sub(r"^\[[^\]]*\]\s*", "", str(error).splitlines()[0] if str(error) else "").split(". ")[0][:160]
        return (f"{'rank' if len(dead) == 1 else 'ranks'} {', '.join(str(r['rank']) for r in dead)} died: {who}; "
                f"rank {self.rank} lost {'it' if len(dead) == 1 else 'them'} during {where} "
                f"({type(error).__name__}: {first}). The job stops; its launcher's output says how the rank ended")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        try:
            os.kill(pid, 0)  # no /proc (not Linux): existence only
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] not in (b"Z", b"X")  # a zombie has ended
