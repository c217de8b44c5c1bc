"""The launcher of fault-tolerant replica groups (`[fault_tolerance]`): torchft's lighthouse, and one torchrun job
per replica group, each restarted on its own when it fails while the others train on.

- The lighthouse (torchft's quorum server, `LighthouseServer` from its wheel) runs as a child process of the
  launcher (`python -m megazoo.workers.replica_groups lighthouse ...`, dying with it) unless the recipe names a
  running one; its address is printed and given to every worker (TORCHFT_LIGHTHOUSE).
- Group G runs as a `Job` (workers/supervisor.py: own session, no orphans, no overlapping attempts) with
  MEGAZOO_REPLICA_GROUP=G. A group whose attempt fails (a rank was killed, ...) is started again, alone, up to
  `max_group_restarts` times: its new workers join the next quorum and heal from a live group (not from disk),
  while the other groups never stop. Once a group has finished training, failed groups are not restarted.
- The lighthouse's death: the workers cannot form a quorum, so each group saves its last committed step, records it
  (`record_lighthouse_gone`) and exits with LIGHTHOUSE_GONE_EXIT; the launcher then falls back to the normal restart path: a new lighthouse (when it
  owns one) and every group started again from its latest checkpoint (`resume_argv`), or, with a lighthouse it
  was given, the job ends saying how to continue.
- SIGTERM / SIGINT to the launcher reach every group's workers once (they finish the step, save and stop).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from megazoo.workers.supervisor import STOP_FILE_ENV, Job, die_with_parent, torchrun_command, worker_threads

LIGHTHOUSE_GONE_EXIT = 75  # a group's workers lost the lighthouse after saving their last committed step
LIGHTHOUSE_GONE = "lighthouse-gone"  # what they record in the launcher's stop file (torchrun's exit status is 1)
GROUP_ENV = "MEGAZOO_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
HOSTNAME_ENV = "MEGAZOO_FT_HOSTNAME"  # where other groups reach this group's torchft manager (default: host name)
RESTART_ENV = "MEGAZOO_REPLICA_RESTART"  # "1" for a group restarted after a failure (it heals, never starts alone)


def record_lighthouse_gone() -> bool:
    """A worker lost the lighthouse (and saved): tell the launcher, which falls back to a whole restart instead of
    restarting the group. torchrun ends with status 1 whatever its worker's, so the stop file carries it (as
    supervisor.record_fatal does). False when no launcher listens."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path:
        return False
    with open(path, "w") as f:
        f.write(LIGHTHOUSE_GONE)
    return True


def _lost_lighthouse(job: Job, code: int) -> bool:
    try:
        with open(job.stop_file) as f:
            recorded = f.read() == LIGHTHOUSE_GONE
    except OSError:
        recorded = False
    return recorded or code == LIGHTHOUSE_GONE_EXIT


@dataclass(frozen=True)
class LighthouseSettings:
    min_replicas: int = 1
    join_timeout_ms: int = 500
    heartbeat_timeout_ms: int = 5000
    quorum_tick_ms: int = 20
    port: int = 0  # 0: any free port (one machine); a fixed one where other nodes must find it (megazoo launch)


class Lighthouse:
    """torchft's lighthouse as a child process that dies with this one; `address` once it listens."""

    def __init__(self, settings: LighthouseSettings, env: dict[str, str] | None = None):
        s = settings
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megazoo.workers.replica_groups", "lighthouse", str(s.min_replicas),
             str(s.join_timeout_ms), str(s.heartbeat_timeout_ms), str(s.quorum_tick_ms), str(s.port)],
            stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().strip() if self.proc.stdout is not None else ""
        if not line.startswith("http"):
            self.proc.kill()
            raise RuntimeError(f"megazoo: the torchft lighthouse did not start (it said {line!r}); is torchft "
                               "installed? pip install 'megazoo[ft]'")
        self.address = line

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()


def _lighthouse_class():
    """torchft's LighthouseServer from its compiled module alone: `import torchft` would import torch first (seconds
    of start-up for a server that needs none of it)."""
    import importlib.machinery
    import importlib.util
    spec = importlib.util.find_spec("torchft")  # finds the package without running its __init__
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "_torchft" + suffix)
            if os.path.exists(path):
                loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", path)
                module = importlib.util.module_from_spec(importlib.util.spec_from_loader("torchft._torchft", loader))
                loader.exec_module(module)
                return module.LighthouseServer
    from torchft._torchft import LighthouseServer  # an install laid out otherwise: the slow way
    return LighthouseServer


def serve_lighthouse(argv: Sequence[str]) -> int:
    """The lighthouse child: bind any free port, print the address, serve until killed (or the launcher dies)."""
    die_with_parent(signal.SIGKILL)
    LighthouseServer = _lighthouse_class()
    min_replicas, join_ms, heartbeat_ms, tick_ms, port = (int(a) for a in argv)
    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_ms,
                              quorum_tick_ms=tick_ms, heartbeat_timeout_ms=heartbeat_ms)
    print(server.address(), flush=True)
    while True:
        time.sleep(3600)


@dataclass
class _Group:
    index: int
    job: Job
    restarts: int = 0
    code: int | None = None  # the last attempt's exit status
    done: bool = False  # trained to the end
    gone: bool = False  # lost the lighthouse
    stopped: int | None = None  # stopped by this signal
    log: list[str] = field(default_factory=list)


def launch_replica_groups(groups: int, nproc: int, module: str, argv: Sequence[str], *, lighthouse: str = "",
                          settings: LighthouseSettings = LighthouseSettings(), max_group_restarts: int = 3,
                          resume_argv: Sequence[str] = (), lighthouse_restarts: int = 1,
                          env: dict[str, str] | None = None, command=torchrun_command) -> int:
    """Run `groups` replica groups of `nproc` workers each (`python -m module argv`) and return the job's exit
    status: 0 when training finished (in at least one group, every other group finished or was dropped), 128 +
    signal when stopped by one, else the failure's. See the module docstring for restarts and the lighthouse.
    `command(nproc, module, argv)`: each attempt's command line (torchrun's; tests pass a plain process)."""
    owned = not lighthouse
    house = Lighthouse(settings) if owned else None
    address = house.address if house is not None else lighthouse
    print(f"megazoo: torchft lighthouse {'started' if owned else 'given'} at {address}"
          f"{f' (pid {house.proc.pid})' if house is not None else ''}; {groups} replica groups of {nproc} "
          f"process{'es' if nproc != 1 else ''}", file=sys.stderr, flush=True)
    base_env = {**worker_threads(nproc * groups), **(env or {})}
    members = [_Group(g, Job({**base_env, GROUP_ENV: str(g), LIGHTHOUSE_ENV: address})) for g in range(groups)]
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def forward(signum, _frame):
            for m in members:
                m.job.signals.append(signum)
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    extra: list[str] = []
    try:
        for round_ in range(lighthouse_restarts + 1):
            _run_round(members, command(nproc, module, list(argv) + extra), max_group_restarts)
            if not any(m.gone for m in members) or any(m.stopped is not None for m in members):
                break
            if not owned or round_ == lighthouse_restarts:
                print(f"megazoo: error: the torchft lighthouse at {address} is gone; every replica group saved its "
                      f"last committed step. Continue with `megazoo train ... --resume` once "
                      f"{'a lighthouse runs there' if not owned else 'you are ready'} (the normal restart path)",
                      file=sys.stderr, flush=True)
                return 1
            house.stop()
            house = Lighthouse(settings)
            address = house.address
            print(f"megazoo: the torchft lighthouse is gone: falling back to the normal restart path: a new lighthouse "
                  f"at {address}, every replica group resumes from its latest checkpoint", file=sys.stderr, flush=True)
            for m in members:
                m.job.env[LIGHTHOUSE_ENV] = address
                m.gone, m.done, m.code = False, False, None
                m.job.env[RESTART_ENV] = "0"  # a whole restart: every group resumes from its own checkpoint
            extra = list(resume_argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for m in members:
            m.job.__exit__(None, None, None)
        if house is not None:
            house.stop()
    stopped = [m.stopped for m in members if m.stopped is not None]
    if stopped:
        return 128 + stopped[0]
    if any(m.done for m in members):
        return 0
    return next((m.code for m in members if m.code), 1)


def _run_round(members: list[_Group], command: list[str], max_restarts: int) -> None:
    """Every group's attempts, each group in its own thread, until each finished, stopped, lost the lighthouse or
    ran out of restarts."""
    threads = [threading.Thread(target=_group_loop, args=(m, members, command, max_restarts), daemon=True)
               for m in members]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.2)


def _group_loop(m: _Group, members: list[_Group], command: list[str], max_restarts: int) -> None:
    while True:
        code = m.job.attempt(command)
        m.code = code
        stopped = m.job.stopped_by(code)
        if stopped is not None:
            m.stopped = stopped
            return
        if code == 0:
            m.done = True
            return
        if _lost_lighthouse(m.job, code):
            m.gone = True
            return
        if m.job.fatal() or m.restarts >= max_restarts or any(p.done or p.gone for p in members):
            why = ("a restart would repeat the error" if m.job.fatal() else
                   "another group has finished or lost the lighthouse" if m.restarts < max_restarts else
                   f"no restarts left (fault_tolerance.max_group_restarts = {max_restarts})")
            print(f"megazoo: replica group {m.index} failed (exit code {code}) and is dropped: {why}",
                  file=sys.stderr, flush=True)
            return
        m.restarts += 1
        m.job.env[RESTART_ENV] = "1"
        print(f"megazoo: replica group {m.index} failed (exit code {code}); restarting it: it rejoins the quorum and "
              f"heals from a live group ({max_restarts - m.restarts} restart(s) left)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "lighthouse":
        sys.exit(serve_lighthouse(sys.argv[2:]))
    sys.exit("usage: python -m megazoo.workers.replica_groups lighthouse MIN_REPLICAS JOIN_MS HEARTBEAT_MS TICK_MS PORT")
