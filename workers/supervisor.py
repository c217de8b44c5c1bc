"""The one launcher of local jobs: `megazoo train` and `megazoo eval --tp N` start their workers here.

- `torchrun_command(N, module, argv)` / `launch_local(N, module, argv, max_restarts=...)`:
  `python -m torch.distributed.run --standalone` with N local workers running `python -m module argv...`,
  each attempt a fresh torchrun.
- The launcher owns its workers (`Job`): torchrun runs in its own session, dies with the launcher
  (PR_SET_PDEATHSIG) and makes its workers die with it (`die_with_parent` in the worker); SIGTERM / SIGINT to
  the launcher are forwarded once to the workers (they finish the step, save a checkpoint and stop), a second
  one kills the job; a stop by signal ends the job (no restart) with exit status 128 + signal (143 for
  SIGTERM); an error a restart would repeat (`record_fatal`) ends it too; and no attempt starts while a process
  of the previous one is alive.
- With `ring_dump` (`megazoo train`): SIGUSR1 to the launcher is forwarded to the workers (each writes its ring of
  recent collectives, rank 0 prints which rank waits where: parallel/flight_recorder.py), and before the job is
  killed the workers get SIGUSR1 and `RING_DUMP_WAIT_S` to do the same.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

JOB_ENV = "MEGAZOO_JOB"  # a token in the environment of every process of one launch (torchrun and its workers)
LAUNCHER_PID_ENV = "MEGAZOO_LAUNCHER_PID"  # the launcher's pid, for a worker's orphan check
STOP_FILE_ENV = "MEGAZOO_STOP_FILE"  # where a worker stopped by a signal records it (the launcher ends the job)
STOP_GRACE_S = 300.0  # after forwarding a stop, how long the workers may take to save before they are killed
NO_WORKER_WAIT_S = 10.0  # a stop that finds no worker waits this long for one (or for torchrun to end) first
RING_DUMP_WAIT_S = 12.0  # before a kill: time for the workers' ring dumps (rank 0 waits up to 10 s for its peers')
_PR_SET_PDEATHSIG = 1
_LIBC: Any = None


def _prctl_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux") or _LIBC is None:
        return False
    return _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _load_libc() -> None:
    global _LIBC
    if sys.platform.startswith("linux") and _LIBC is None:
        import ctypes
        _LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux prctl PR_SET_PDEATHSIG, kept
    across exec; False elsewhere). A torchrun worker calls it first thing, so a killed torchrun takes it along."""
    _load_libc()
    return _prctl_pdeathsig(sig)


def _ppid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def orphaned() -> bool:
    """True when this worker's torchrun (or, under `megazoo train`, the launcher above it) is already gone: it
    died before `die_with_parent` took effect, and this process was re-parented."""
    parent = os.getppid()
    if parent == 1:
        return True
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not os.path.isdir("/proc"):
        return False
    return int(launcher) not in (parent, _ppid_of(parent))


class GracefulStop:
    """A worker's stop request, while open (a context manager, in the main thread): the first SIGTERM or SIGINT
    only sets `signum` (the training loop finishes its step, saves a checkpoint and stops); the next one of
    either kills the process at once (the default action is back)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, _frame) -> None:
        self.signum = signum
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


def record_stop(signum: int) -> bool:
    """A worker stopped by signal `signum` (and saved): tell the launcher, which then ends the job with status
    128 + signum instead of restarting it. False when no `megazoo train` launcher is listening."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path:
        return False
    with open(path, "w") as f:
        f.write(str(int(signum)))
    return True


def record_fatal() -> bool:
    """A worker hit an error that a restart would only repeat (a save that failed for lack of disk space,
    damaged checkpoints, a changed batch): tell the launcher to end the job instead of restarting it. False
    when no `megazoo train` launcher is listening."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path:
        return False
    with open(path, "w") as f:
        f.write("fatal")
    return True


def _job_processes(token: str) -> list[int]:
    """Live processes (zombies excluded: their environment reads empty) whose environment holds the job token."""
    needle, found = f"{JOB_ENV}={token}".encode(), []
    if not os.path.isdir("/proc"):  # not Linux: torchrun is signalled instead of its workers
        return found
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def _signal(pid: int, sig: int, *, group: bool) -> None:
    """Signal process `pid`, or the process group it leads (falling back to the process when it leads none)."""
    try:
        if group:
            try:
                os.killpg(pid, sig)
                return
            except ProcessLookupError:
                pass
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Job:
    """The processes of one `launch_local`, attempt after attempt. While it is open (a context manager):

    - SIGTERM / SIGINT to this process are caught; the first is forwarded once, as it is, to every worker
      (torchrun's children; torchrun itself when none shows up within `no_worker_wait_s`, see `_forward`): they
      finish the step, save and stop. A second
      signal, or workers still running `STOP_GRACE_S` later, kill the job (SIGKILL to torchrun's process group,
      and to the workers: each runs in its own session, torchrun's doing).
    - torchrun runs in its own session (a Ctrl-C in the terminal reaches only the launcher, which forwards it
      once) and dies with this process (PR_SET_PDEATHSIG SIGKILL, set between fork and exec).
    - `attempt()` returns only when no process of the attempt is left (found by the job token in /proc/*/environ):
      a restart never overlaps the workers of the attempt before it.
    """

    def __init__(self, env: dict[str, str] | None = None, *, stop_grace_s: float = STOP_GRACE_S,
                 no_worker_wait_s: float = NO_WORKER_WAIT_S, ring_dump: bool = False,
                 ring_dump_wait_s: float = RING_DUMP_WAIT_S):
        self.ring_dump, self.ring_dump_wait_s, self._dump_requests = ring_dump, ring_dump_wait_s, 0
        self.token = f"{os.getpid()}-{os.urandom(6).hex()}"
        self.stop_grace_s, self.no_worker_wait_s = stop_grace_s, no_worker_wait_s
        self._stop_announced: float | None = None
        self.signals: list[int] = []
        self._dir = tempfile.mkdtemp(prefix="megazoo-job-")
        self.stop_file = os.path.join(self._dir, "stopped")
        self.env = {**os.environ, **(env or {}), JOB_ENV: self.token, LAUNCHER_PID_ENV: str(os.getpid()),
                    STOP_FILE_ENV: self.stop_file}
        self._previous: dict[int, Any] = {}
        _load_libc()  # before any fork: the child only calls prctl between fork and exec

    def __enter__(self) -> Job:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
            if self.ring_dump:
                self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_dump_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _on_signal(self, signum: int, _frame) -> None:
        self.signals.append(signum)  # acted upon by the attempt's wait loop, not inside the handler

    def _on_dump_signal(self, _signum: int, _frame) -> None:
        self._dump_requests += 1  # forwarded by the attempt's wait loop

    def _workers(self, torchrun_pid: int) -> list[int]:
        return [pid for pid in _job_processes(self.token) if _ppid_of(pid) == torchrun_pid]

    def _dump_rings(self, torchrun_pid: int) -> None:
        """SIGUSR1 to every worker (each writes its ring; rank 0 prints the diagnosis): not a stop."""
        for pid in self._workers(torchrun_pid):
            _signal(pid, signal.SIGUSR1, group=False)

    def stopped_by(self, code: int) -> int | None:
        """The signal that stopped the attempt that ended with `code`: one a worker recorded after saving, else
        the launcher's own when the attempt did not succeed; None when it was not stopped by a signal."""
        try:
            with open(self.stop_file) as f:
                recorded: int | None = int(f.read())
        except (OSError, ValueError):
            recorded = None
        return self.signals[0] if self.signals and (recorded is not None or code != 0) else recorded

    def fatal(self) -> bool:
        """Whether a worker of the last attempt recorded an error that a restart would repeat (record_fatal)."""
        try:
            with open(self.stop_file) as f:
                return f.read() == "fatal"
        except OSError:
            return False

    def attempt(self, command: list[str]) -> int:
        """Run one torchrun; its exit status (128 + N when a signal N ended it), once all its processes are gone."""
        if os.path.exists(self.stop_file):
            os.unlink(self.stop_file)
        proc = subprocess.Popen(command, env=self.env, start_new_session=True,
                                preexec_fn=lambda: _prctl_pdeathsig(signal.SIGKILL))
        forwarded_at: float | None = None  # when the stop reached the workers (or torchrun)
        killed = False
        try:
            while True:
                try:
                    code = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self._dump_requests:
                    self._dump_requests = 0
                    self._dump_rings(proc.pid)
                if not self.signals:
                    continue
                now = time.monotonic()
                if len(self.signals) > 1 or (forwarded_at is not None and now - forwarded_at > self.stop_grace_s):
                    if not killed:
                        print("megazoo: killing the job", file=sys.stderr, flush=True)
                        self._dump_before_kill(proc)
                        self._kill_all(proc.pid)
                        killed = True
                elif forwarded_at is None and self._forward(proc.pid, now):
                    forwarded_at = now
        finally:
            if proc.poll() is None:  # an exception (not a signal) left the loop
                self._kill_all(proc.pid)
                proc.wait()
            self._reap()
        return 128 - code if code < 0 else code

    def _forward(self, torchrun_pid: int, now: float) -> bool:
        """Forward the first stop signal to torchrun's workers; True once it is delivered (or needs no delivery).

        With no worker alive the signal is held for up to `no_worker_wait_s`: the workers may have stopped and
        saved already (a multi-node job: the other node's stop reached them through the step's all-reduced stop
        flag), and torchrun then ends on its own; signalling it instead would take it out of the elastic agents'
        exit barrier and leave the other node's torchrun waiting there. Only when no worker shows up at all
        (torchrun still in its rendezvous) is torchrun itself signalled."""
        if self._stop_announced is None:
            name = signal.Signals(self.signals[0]).name
            print(f"megazoo: {name}: stopping the job (the workers finish their step, save a checkpoint "
                  f"and stop; send it again to kill them now)", file=sys.stderr, flush=True)
            self._stop_announced = now
        workers = self._workers(torchrun_pid)
        for pid in workers:
            _signal(pid, self.signals[0], group=True)
        if workers or os.path.exists(self.stop_file):
            return True
        if now - self._stop_announced < self.no_worker_wait_s:
            return False
        _signal(torchrun_pid, self.signals[0], group=True)
        return True

    def _dump_before_kill(self, proc: subprocess.Popen) -> None:
        """With `ring_dump`: the workers' rings written (and rank 0's diagnosis printed) before the kill; the wait
        ends early once torchrun is gone (a third signal does not shorten it: the kill follows in seconds)."""
        if not self.ring_dump or not self._workers(proc.pid):
            return
        self._dump_rings(proc.pid)
        try:
            proc.wait(timeout=self.ring_dump_wait_s)
        except subprocess.TimeoutExpired:
            pass

    def _kill_all(self, torchrun_pid: int) -> None:
        _signal(torchrun_pid, signal.SIGKILL, group=True)
        for pid in _job_processes(self.token):
            _signal(pid, signal.SIGKILL, group=False)

    def _reap(self, timeout_s: float = 60.0) -> None:
        """Wait until no process of this job is alive; SIGKILL the ones left (workers of a killed torchrun)."""
        if not os.path.isdir("/proc"):
            return
        deadline = time.monotonic() + timeout_s
        while (left := _job_processes(self.token)) and time.monotonic() < deadline:
            for pid in left:
                _signal(pid, signal.SIGKILL, group=False)
            time.sleep(0.05)
        if left:
            raise RuntimeError(f"megazoo: processes {left} of the job survived SIGKILL for {timeout_s:.0f}s")


def torchrun_command(nproc: int, module: str, argv: Sequence[str] = ()) -> list[str]:
    """The command that runs `python -m module *argv` on `nproc` local workers under torchrun (this
    interpreter, a standalone rendezvous on this machine; each worker reads RANK/WORLD_SIZE from torchrun)."""
    if nproc < 1:
        raise ValueError(f"nproc {nproc} is invalid: it must be a positive integer")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *map(str, argv)]


def worker_threads(nproc: int) -> dict[str, str]:
    """{"OMP_NUM_THREADS": the usable cores / nproc, at least 1} unless the user set it. torchrun would set 1
    itself and print a warning banner on every run; we choose, quietly, and a user's value always wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // max(1, nproc)))}


def launch_local(nproc: int, module: str, argv: Sequence[str] = (), *, max_restarts: int = 0,
                 restart_note: str = "", env: dict[str, str] | None = None, ring_dump: bool = False) -> int:
    """Run `torchrun_command(nproc, module, argv)` and return its exit status; after a failure start it again,
    every worker, up to `max_restarts` times (a message on stderr names the attempt; `restart_note` adds what
    the restarted job will do). Each attempt is a fresh torchrun with a fresh rendezvous: torchrun's own
    --max-restarts reuses the rendezvous, and with torch 2.13 + gloo the restarted ranks intermittently failed
    to reconnect ("connectFullMesh ... Connection refused").

    A stop by signal is not a failure and is never restarted: SIGTERM / SIGINT to this process (forwarded to the
    workers, see `Job`), or a worker that recorded a stop by signal (`record_stop`), end the job with
    status 128 + signal. `env` is added to the workers' environment, with OMP_NUM_THREADS (`worker_threads`).
    `ring_dump`: the workers handle SIGUSR1 (recipes/train.py), so the launcher forwards it (see `Job`)."""
    if max_restarts < 0:
        raise ValueError(f"max_restarts {max_restarts} is invalid: it must be 0 (no restarts) or more")
    command = torchrun_command(nproc, module, argv)
    with Job({**worker_threads(nproc), **(env or {})}, ring_dump=ring_dump) as job:
        for attempt in range(max_restarts + 1):
            code = job.attempt(command)
            stopped = job.stopped_by(code)
            if stopped is not None:
                return 128 + stopped
            if code == 0 or attempt == max_restarts or job.fatal():
                return code
            workers = f"{nproc} worker{'s' if nproc != 1 else ''}"
            print(f"megazoo: attempt {attempt + 1} failed (exit code {code}); restarting all {workers}"
                  f"{restart_note} ({max_restarts - attempt} restart(s) left)", file=sys.stderr, flush=True)
    return code
