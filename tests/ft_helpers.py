"""Fault-tolerant replica groups in tests: each group one forked process (no torchrun: seconds, not tens of them)
running the same code a `megazoo train` worker runs (replica_setup -> Trainer -> replica_fit), against a torchft
lighthouse in a child process (workers/replica_groups.Lighthouse). The test plays the launcher: it kills and
restarts groups itself."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import traceback
from pathlib import Path

import torch

from recipe_helpers import tiny_recipe

from megazoo.parallel.checkpoint.views import optimizer_steps
from megazoo.parallel.topology import Topology
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.metrics import MetricsLog
from megazoo.recipes.training.replicated import replica_fit, replica_setup
from megazoo.recipes.training.trainer import Trainer
from megazoo.workers.replica_groups import GROUP_ENV, LIGHTHOUSE_ENV, RESTART_ENV, Lighthouse, LighthouseSettings

FT = {"enabled": True, "replica_groups": 2, "timeout_s": 10.0, "quorum_timeout_s": 3.0, "start_timeout_s": 20.0}


def lighthouse(join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 1000) -> Lighthouse:
    """torchft's lighthouse in a child process, as `megazoo train` runs it. Not in the test process: its threads
    resolve host names, and a group forked while one of them held the resolver's lock crashed in getaddrinfo.
    A quorum waits up to join_timeout for a group that heartbeats but has not asked yet: 1 s, so that on a loaded
    machine a restarted group and a live one released by it meet in one quorum (only a failure or a join waits)."""
    return Lighthouse(LighthouseSettings(min_replicas=1, join_timeout_ms=join_timeout_ms,
                                         heartbeat_timeout_ms=heartbeat_timeout_ms))


def ft_sections(run_dir: Path, steps: int, **extra) -> dict:
    sections = {"parallel": {"dp": 2}, "train": {"steps": steps, "warmup_steps": 2},
                "run": {"dir": str(run_dir)}, "sample": {"tokens": 0}, "fault_tolerance": dict(FT)}
    for name, values in extra.items():
        sections.setdefault(name, {}).update(values)
    return sections


def _hold(holds: list[tuple[int, str]]) -> None:
    """Test scaffolding for a loaded machine: before the quorum of step `at` (and of every later step) this group
    waits until the file `ready` exists, for each (at, ready) in `holds`; the restarted group touches it as it starts
    its first quorum (`_ready_at_join`), so the run cannot end before that group could rejoin. The wait sits before
    the quorum, never between a quorum and its step: a held group is in no quorum, a joiner's quorum request meets
    it at its next one (the lighthouse waits join_timeout for a group that heartbeats), and a group that joined the
    quorum just before a hold can never leave the held one waiting on it. Patched on this fork's class only."""
    from megazoo.parallel.fault_tolerance import replica
    begin = replica.ReplicaGroup.begin_step

    def held(self) -> int:
        for at, ready in holds:
            while self.manager.current_step() >= at and not os.path.exists(ready):
                time.sleep(0.02)
        return begin(self)
    replica.ReplicaGroup.begin_step = held


def _ready_at_join(ready: str) -> None:
    """Touch `ready` as this (restarted) group starts its first quorum, once every rank of it is there (torchft asks
    the lighthouse only when all have called it): what a held live group waits for."""
    import torch.distributed as dist

    from megazoo.parallel.fault_tolerance import replica
    join = replica.ReplicaGroup.join

    def joining(self, *args, **kwargs) -> int:
        if dist.is_initialized():
            dist.barrier()
        Path(ready).touch()
        return join(self, *args, **kwargs)
    replica.ReplicaGroup.join = joining


def _group_main(group: int, sections: dict, address: str, out: str, resume: bool, restarted: bool,
                hold: tuple[int, str] | None, ready: str | None, progress: bool) -> None:
    torch.set_num_threads(1)
    import faulthandler
    crash = open(out + ".crash", "w")
    faulthandler.enable(crash)
    try:
        env = {GROUP_ENV: str(group), LIGHTHOUSE_ENV: address, RESTART_ENV: "1" if restarted else "0"}
        recipe, spec = replica_setup(tiny_recipe(**sections), env)
        if resume:
            from dataclasses import replace
            recipe = replace(recipe, checkpoint=replace(recipe.checkpoint, resume=True))
        res = resolve(recipe, world_size=1)
        trainer = Trainer(res, Topology.solo(), replica_group=group)
        log = MetricsLog(res.recipe.run.dir, enabled=True)
        start = checkpointing.restore(trainer, report=lambda *_: None)
        if hold is not None:
            _hold([hold])
        if ready is not None:
            _ready_at_join(ready)
        result = replica_fit(trainer, spec, log, start, None, progress=progress)
        views = trainer.zero.state_views()
        torch.save({"names": [f"{v.kind}:{v.name}:{v.start}" for v in views],
                    "tensors": [v.tensor.clone() for v in views], "optimizer_steps": optimizer_steps(trainer.optimizer),
                    "losses": result.losses, "val_loss": result.val_loss}, out)
    except BaseException as err:  # noqa: BLE001 - the test reads it
        torch.save({"error": traceback.format_exc(), "kind": type(err).__name__}, out)
    os._exit(0)  # torchft's threads must not hold the process


_WARM: list[bool] = []


def _warm_up() -> None:
    """Build one Trainer in the test process before the first fork: its first build here takes seconds (lazy
    imports, the synthetic corpus), which every forked group would otherwise pay again."""
    if not _WARM:
        Trainer(resolve(tiny_recipe()), Topology.solo())
        _WARM.append(True)


def start_group(group: int, sections: dict, address: str, out: Path, resume: bool = False, restarted: bool = False,
                hold: tuple[int, Path] | None = None, ready: Path | None = None, progress: bool = False) -> mp.Process:
    _warm_up()
    hold_arg = (hold[0], str(hold[1])) if hold is not None else None
    proc = mp.get_context("fork").Process(target=_group_main, args=(group, sections, address, str(out), resume,
                                                                    restarted, hold_arg, ready and str(ready),
                                                                    progress))
    proc.start()
    return proc


def metrics(run_dir: Path, group: int) -> list[dict]:
    path = Path(run_dir) / f"group-{group}" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.02)


def finish(procs: list[mp.Process], outs: list[Path], timeout_s: float = 60.0) -> list[dict]:
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = [torch.load(o, weights_only=False) if o.exists() else
               {"error": f"no result (exit code {p.exitcode}): {Path(str(o) + '.crash').read_text()[-3000:]}"}
               for o, p in zip(outs, procs)]
    errors = [f"group {g}: {r['error']}" for g, r in enumerate(results) if "error" in r]
    assert not errors, "\n".join(errors)
    return results


def _arm(trainer: Trainer, rank: int, die: tuple[int, str, int] | None, died: str) -> None:
    """Test scaffolding for a failure at a chosen point: rank `die[0]` SIGKILLs itself in the middle of step
    `die[2]` (after its forward and backward, before the optimizer step: gradients half reduced) when die[1] is
    "step", while it applies the state a live group sent it (the heal) when "heal", or inside torchft's transfer
    of that state (the sender serving it) when "transfer". A death in the heal first writes its time to `died`."""
    if die is None or die[0] != rank:
        return

    def die_now(*_, **__) -> None:
        Path(died).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if die[1] == "transfer":
        from torchft.checkpointing.http_transport import HTTPTransport
        HTTPTransport.recv_checkpoint = die_now  # this fork's class only
        return
    if die[1] == "heal":
        from megazoo.parallel.fault_tolerance import replica
        replica.HealState.load_state_dict = die_now  # this fork's class only
        return
    step_fn, run, at = trainer.train_step, trainer.engine.run, die[2]
    current = [-1]

    def step(step: int, stop: bool = False) -> dict:
        current[0] = step
        return step_fn(step, stop)

    def engine_run(*args, **kwargs):
        out = run(*args, **kwargs)
        if current[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    trainer.train_step, trainer.engine.run = step, engine_run


# ---- replica groups of several ranks (forked, no port race) -------------------------------------------------------
def _ranks_main(group: int, rank: int, nproc: int, ports, sections: dict, address: str, out: str,
                options: dict) -> None:
    """One rank of an `nproc`-rank replica group. Rank 0 binds its TCPStore on a port the kernel picks (port 0) and
    hands it to the others through `ports` (a pipe per peer): no port is chosen before it is bound, so no other
    process on a busy machine can take it in between. options: restarted (bool), die (see _arm), holds
    [(step, file)] (see _hold), `joining`: the file touched once every rank is at the group's first quorum request
    (_ready_at_join; a live group held on it then meets it in its next quorum), snapshots (see start_ranks)."""
    torch.set_num_threads(1)
    try:
        from dataclasses import replace

        from torch.distributed import TCPStore

        from megazoo.parallel.topology import init_distributed
        if rank == 0:
            store = TCPStore("localhost", 0, nproc, is_master=True, wait_for_workers=False)
            port = store.port
            for pipe in ports:
                pipe.send(port)
        else:
            port = ports.recv()
            store = TCPStore("localhost", port, nproc, is_master=False, wait_for_workers=False)
        init_distributed(rank, nproc, store, timeout_s=120)
        env = {GROUP_ENV: str(group), LIGHTHOUSE_ENV: address, "WORLD_SIZE": str(nproc), "MASTER_ADDR": "localhost",
               "MASTER_PORT": str(port), RESTART_ENV: "1" if options.get("restarted") else "0"}
        recipe, spec = replica_setup(tiny_recipe(**sections), env)
        res = resolve(recipe, world_size=nproc)
        topo = Topology.of(replace(recipe.parallel, dp=recipe.parallel.dp // spec.groups))
        trainer = Trainer(res, topo, replica_group=group)
        _arm(trainer, rank, options.get("die"), out + ".died")
        _hold(options.get("holds") or [])
        if options.get("joining") is not None:
            _ready_at_join(options["joining"])
        snapshots: dict[int, dict] = {}
        if options.get("snapshots"):  # the full parameters each step starts from (collective: every rank takes it)
            step_fn = trainer.train_step

            def snapshot_then_step(step: int, stop: bool = False) -> dict:
                snapshots[step] = {k: v.clone() for k, v in trainer.full_state_dict().items()}
                return step_fn(step, stop)
            trainer.train_step = snapshot_then_step
        result = replica_fit(trainer, spec, MetricsLog(res.recipe.run.dir, enabled=rank == 0), 0, None)
        views = trainer.zero.state_views()
        torch.save({"losses": result.losses, "full": trainer.full_state_dict(),
                    "names": [f"{v.kind}:{v.name}:{v.start}" for v in views],
                    "tensors": [v.tensor.clone() for v in views],
                    "optimizer_steps": optimizer_steps(trainer.optimizer), "snapshots": snapshots}, out)
    except BaseException:  # noqa: BLE001 - the test reads it
        torch.save({"error": traceback.format_exc()}, out)
    os._exit(0)


def start_ranks(group: int, sections: dict, address: str, outs: list[Path], **options) -> list[mp.Process]:
    """Replica group `group` as len(outs) forked ranks (see _ranks_main): options restarted, die, holds
    [(step, file)], joining (file), snapshots (bool: the result holds the full parameters each step started from,
    by step; a step run again after a failed one keeps its last)."""
    _warm_up()
    ctx = mp.get_context("fork")
    nproc = len(outs)
    pipes = [ctx.Pipe(duplex=False) for _ in range(nproc - 1)]  # (receiving end, sending end) per peer of rank 0
    options = {**options, "holds": [(step, str(path)) for step, path in options.get("holds") or ()],
               "joining": str(options["joining"]) if options.get("joining") is not None else None}
    procs = [ctx.Process(target=_ranks_main, args=(group, r, nproc, [s for _, s in pipes] if r == 0 else
                                                   pipes[r - 1][0], sections, address, str(outs[r]), options))
             for r in range(nproc)]
    for p in procs:
        p.start()
    return procs


def published_files(run_dir: Path, group: int) -> dict[str, str]:
    """sha256 of every published checkpoint file of a group (step_N folders only: nothing in flight)."""
    import hashlib
    root = Path(run_dir) / f"group-{group}" / "checkpoints"
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.glob("step_*/**/*")) if p.is_file()}


def end_group_after_a_death(procs: list[mp.Process], rank: int, timeout_s: float = 300) -> None:
    """Rank `rank` SIGKILLs itself (see _arm): once it is dead, end the others as torchrun would (it stops a group
    whose worker died). A peer may have ended by itself first (its collective with the dead rank failed): how it
    ended does not matter, torchrun ends it either way."""
    wait_for(lambda: procs[rank].exitcode is not None, timeout_s, f"rank {rank} of the group to die")
    assert procs[rank].exitcode == -signal.SIGKILL, [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            os.kill(p.pid, signal.SIGKILL)
        p.join()


def patient_lighthouse() -> Lighthouse:
    """A lighthouse that waits up to 3 s for a group that heartbeats but has not asked for this quorum yet (a
    process starved on a loaded machine), so a restarted group that is joining meets the live one in its next
    quorum instead of each forming one alone."""
    return lighthouse(join_timeout_ms=3000, heartbeat_timeout_ms=2000)


def assert_healed_bitwise_and_nothing_lost(results: list[dict], run_dir: Path, steps: int, kill_at: int, every: int,
                                           before: dict[str, str], lines_before: list[dict], what) -> None:
    """After a run with a failure (2 groups of 2 ranks, group 1 failed at step `kill_at`): every rank of group 1
    equals the same rank of group 0 bit for bit (its state views: parameters or shards, fp32 masters, Adam moments;
    the update count; the full parameters), and group 1's checkpoints (sha256, `before`) and metrics lines from
    before the failure are unchanged."""
    from megazoo.parallel.checkpoint.io import step_dir
    for r in range(2):
        a, b = results[r], results[2 + r]
        assert a["names"] == b["names"] and a["optimizer_steps"] == b["optimizer_steps"] == steps
        assert all(torch.equal(x, y) for x, y in zip(a["tensors"], b["tensors"])), (what, r)
        assert all(torch.equal(a["full"][k], b["full"][k]) for k in a["full"])
    assert any(k.startswith(step_dir(Path(), every).name + "/") for k in before), before
    after = published_files(run_dir, 1)
    assert {k: after.get(k) for k in before} == before
    assert metrics(run_dir, 1)[:kill_at] == lines_before
