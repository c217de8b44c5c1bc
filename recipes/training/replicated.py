"""The training loop of one fault-tolerant replica group (`[fault_tolerance]`, parallel/fault_tolerance/replica.py).

The same steps as `Trainer.fit`, but the step number comes from torchft's quorum, not from a counter: each step
starts with the quorum (`begin_step`), which may move a restarted group forward to the live groups' step after
healing it from one of them; a step the groups do not commit (a group failed during it) is run again under the
next quorum without the failed group, so the live groups never stop and no committed step is redone. Each group
writes its own metrics.jsonl and checkpoints under run.dir/group-G/ (periodic saves go on as without fault
tolerance; a group that restarts never overwrites what it wrote before).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

from megazoo.data.fileio import atomic_write_text
from megazoo.parallel.checkpoint.io import step_dir
from megazoo.parallel.fault_tolerance.replica import HealState, LighthouseGone, ReplicaGroup, rank0_decides
from megazoo.recipes.config import Recipe, RecipeError
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.metrics import MetricsLog
from megazoo.workers.replica_groups import GROUP_ENV, HOSTNAME_ENV, LIGHTHOUSE_ENV, RESTART_ENV  # launchers set them
from megazoo.recipes.training.trainer import Trainer, TrainResult




FINISHED = "replica-groups-finished"  # in run.dir: the step a group trained to (see fit_replicated)


@dataclass(frozen=True)
class ReplicaSpec:
    index: int  # this replica group (0 .. groups - 1)
    groups: int
    lighthouse: str
    store: tuple[str, int] | None  # the group's TCPStore (torchrun's MASTER_ADDR / PORT); None: one process
    restarted: bool = False  # the launcher restarted this group after a failure: it must heal from a live one
    hostname: str | None = None  # the name other groups reach this one's manager at (None: this host's name)


def replica_setup(recipe: Recipe, environ: Mapping[str, str]) -> tuple[Recipe, ReplicaSpec | None]:
    """The recipe as replica group G runs it (its own run.dir: run.dir/group-G) and where the group is, from the
    launcher's environment; (recipe, None) without fault tolerance. Read in the entry point only."""
    ft = recipe.fault_tolerance
    if not ft.enabled:
        return recipe, None
    if GROUP_ENV not in environ:
        raise RecipeError("fault_tolerance.enabled = true: start the run with `megazoo train` (it starts the "
                          "lighthouse and one job per replica group), not python -m megazoo.recipes.train "
                          f"({GROUP_ENV} unset)")
    index = int(environ[GROUP_ENV])
    lighthouse = environ.get(LIGHTHOUSE_ENV) or ft.lighthouse
    world = int(environ.get("WORLD_SIZE", "1"))
    store = (environ["MASTER_ADDR"], int(environ["MASTER_PORT"])) if world > 1 else None
    run = replace(recipe.run, dir=str(Path(recipe.run.dir) / f"group-{index}"))
    # restarted by megazoo train's launcher, or by torchrun itself (megazoo launch: --max-restarts on each group)
    restarted = environ.get(RESTART_ENV, "0") != "0" or environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    hostname = environ.get(HOSTNAME_ENV) or None  # e.g. a pod's full DNS name (recipes/launch/kubernetes.py)
    return replace(recipe, run=run), ReplicaSpec(index, ft.replica_groups, lighthouse, store, restarted, hostname)


def heal_state(trainer: Trainer) -> HealState:
    """Everything of this rank's that a healed group must receive (see HealState): the optimizer's views, the
    routing-bias buffers the checkpoints also save, the loss scaler and the random streams."""
    buffers = [(name, buf) for chunk in trainer.chunks for name, buf in chunk.named_buffers()
               if name.endswith("router.expert_bias")]
    return HealState(trainer.zero, trainer.scaler, tp_rng=trainer.model.rng, device=trainer.topo.device,
                     buffers=buffers)


def replica_fit(trainer: Trainer, spec: ReplicaSpec, log: MetricsLog | None, start_step: int,
                stop_requested: Callable[[], bool] | None, progress: bool = False) -> TrainResult:
    """Join torchft's quorum as replica group `spec.index` and train (`fit_replicated`). A lost lighthouse ends
    training after this group saves its last committed step (LighthouseGone is raised on): nothing is lost."""
    store = spec.store
    own_store = None
    if store is None:  # one process: no torchrun store to publish the manager's address in
        from torch.distributed import TCPStore
        own_store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        store = ("localhost", own_store.port)
    rank0 = trainer.topo.rank == 0
    replicas = ReplicaGroup(trainer.res.recipe.fault_tolerance, trainer.topo, group=spec.index,
                            lighthouse=spec.lighthouse, store=store, heal=heal_state(trainer),
                            hostname=spec.hostname)
    try:
        return fit_replicated(trainer, replicas, log=log, start_step=start_step, stop_requested=stop_requested,
                              report=print if rank0 else (lambda *_: None), restarted=spec.restarted,
                              progress=progress and rank0)
    except LighthouseGone:
        step = replicas.manager.current_step()
        if step > start_step and not step_dir(Path(trainer.res.recipe.run.dir) / "checkpoints", step).exists():
            trainer.save_checkpoint(step)  # the group's own collective: no quorum needed
        raise
    finally:
        replicas.shutdown()
        del own_store


def fit_replicated(trainer: Trainer, replicas: ReplicaGroup, *, log: MetricsLog | None = None,
                   start_step: int = 0, stop_requested: Callable[[], bool] | None = None,
                   report: Callable[[str], None] = print, restarted: bool = False,
                   progress: bool = False) -> TrainResult:
    """Train this replica group until the quorum's step reaches train.steps (see the module docstring)."""
    t, result = trainer.train_cfg, TrainResult()
    every, at_end = trainer.res.recipe.checkpoint.every, trainer.res.recipe.checkpoint.at_end
    trainer.replicas = replicas
    if start_step:
        replicas.set_step(start_step)
    marker = Path(trainer.res.recipe.run.dir).parent / FINISHED  # beside the groups' folders

    def finished() -> bool:  # another group trained to train.steps: nothing left to rejoin
        try:
            return int(marker.read_text()) >= t.steps
        except (OSError, ValueError):
            return False
    step = replicas.join(rank0_decides(trainer.topo), restarted=restarted, finished=finished)
    if step != start_step:
        report(f"megazoo: replica group {replicas.group} healed from a live group at step {step} "
               f"({replicas.live} of {replicas.groups} groups live)")
    if log is not None:
        log.start_at(step, report=report)  # lines of steps this group never trained are not kept
    bar = None
    if progress:  # the progress line shows how many replica groups are live
        from tqdm import tqdm
        bar = tqdm(total=t.steps, initial=step, desc=f"train (group {replicas.group})", unit="step",
                   dynamic_ncols=True)
    try:
        while step < t.steps:
            metrics = trainer.train_step(step, stop=stop_requested is not None and stop_requested())
            stop = metrics.pop("stop")
            if not metrics["committed"]:
                report(f"megazoo: replica group {replicas.group}: step {step} not committed (a replica group failed "
                       f"during it); going on with the live groups")
                step = replicas.begin_step()
                continue
            last = step + 1 == t.steps
            result.losses.append(metrics["loss"])
            result.grad_norms.append(metrics["grad_norm"])
            if log is not None:
                log.write(metrics)
            if bar is not None:
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", live=f"{metrics['replicas_live']}/{replicas.groups}")
                bar.update(step + 1 - bar.n)  # a heal moves the step forward
            if stop or (every and (step + 1) % every == 0) or (last and (every or at_end)):
                result.checkpoint = trainer.save_checkpoint(step + 1)
            if stop:
                result.stopped_at = step + 1
                break
            if last:
                if trainer.topo.rank == 0:
                    atomic_write_text(marker, str(t.steps))  # a group restarting now stops waiting to rejoin
                break
            step = replicas.begin_step()
        checkpointing.wait_for_save(trainer)
    except BaseException:
        checkpointing.abandon_save(trainer)
        raise
    finally:
        if bar is not None:
            bar.close()
        sys.stdout.flush()
    if result.stopped_at is None:
        result.val_loss = trainer.evaluate()
    return result
