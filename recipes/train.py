"""The training entry point: `python -m megazoo.recipes.train RECIPE.toml [--set k=v ...]`, one process per rank.

`megazoo train` checks the recipe and launches this under torchrun (or runs it in place for one process); the
loop itself is recipes/training/trainer.py. This module reads the launcher's RANK / WORLD_SIZE, builds the Topology,
restores a checkpoint when asked, handles SIGTERM / SIGINT (preemption: finish the step, save, stop; exit status
128 + signal) and SIGUSR1 (every rank writes its ring of recent collectives to run.dir/.progress, rank 0 prints
which rank waits in which call: parallel/flight_recorder.py), holds run.dir's lock when no `megazoo train`
launcher does, and prints the run's summary on rank 0.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from megazoo.data.published.catalog import default_folders
from megazoo.data.token_dataset import DataCacheError
from megazoo.kernels import describe_ops
from megazoo.models.transformer import model_ops
from megazoo.parallel.checkpoint.io import CheckpointError
from megazoo.workers.supervisor import GracefulStop, die_with_parent, orphaned, record_fatal, record_stop
from megazoo.workers.local import finish_worker
from megazoo.parallel.topology import Topology, init_distributed, local_device
from megazoo.parallel.fault_tolerance.replica import LighthouseGone, NoLiveGroup
from megazoo.workers.replica_groups import LIGHTHOUSE_GONE_EXIT, record_lighthouse_gone
from megazoo.recipes.training import checkpointing
from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.training.metrics import MetricsLog
from megazoo.recipes.training.plot import plot_runs, read_metrics
from megazoo.recipes.training.progress import Progress, is_collective_timeout
from megazoo.parallel.collective_check import diagnose_mismatch
from megazoo.parallel.flight_recorder import RingDumpOnSignal, diagnose, dump_ring, group_labels, read_rings
from megazoo.recipes.resolve import Resolved, resolve
from megazoo.recipes.resolved_toml import resolved_toml
from megazoo.recipes.training.run_dir import (LOCK_HELD_ENV, RunDirBusy, RunDirLock, check_checkpoints,
                                              write_resolved_recipe)
from megazoo.recipes.training.trainer import Trainer, TrainResult
from megazoo.recipes.training.replicated import ReplicaSpec, replica_fit, replica_setup


def run(res: Resolved, topo: Topology, stop: GracefulStop | None = None,
        group: ReplicaSpec | None = None) -> TrainResult:
    """Train as the recipe says, log on rank 0, and print the closing summary there. SIGTERM / SIGINT (`stop`)
    is a preemption: the current step finishes, every rank saves a checkpoint, training stops."""
    rank0 = topo.rank == 0
    recipe = res.recipe
    stop = stop if stop is not None else GracefulStop()
    with stop:
        log = MetricsLog(recipe.run.dir, enabled=rank0, wandb_mode=recipe.logging.wandb,
                         project=recipe.logging.wandb_project, config=recipe.to_dict())
        try:
            trainer = Trainer(res, topo, replica_group=group.index if group is not None else 0)
            if rank0:
                print("\n".join(describe_ops(trainer.kernels, model_ops(res.model))), flush=True)
            start_step = checkpointing.restore(trainer, report=print if rank0 else (lambda *_: None))
            if group is None:  # (a replica group does it once its quorum says where it starts: replicated.py)
                log.start_at(start_step, report=print)  # one clean history: no line past the step resumed from
            if rank0:  # every field as this job runs it (after overrides, derived values filled in)
                write_resolved_recipe(recipe.run.dir, resolved_toml(res), start_step)
            if rank0:
                n_params = sum(p.numel() for p in trainer.model.parameters())
                cfg = res.model
                origin = "from checkpoint.load, " if recipe.model.from_checkpoint else ""
                cp = f" cp={topo.cp} ({topo.cp_attention})" if topo.cp > 1 else ""
                print(f"megazoo: {cfg.name} ({origin}{cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, "
                      f"vocab {cfg.vocab_size:,}; {cfg.num_parameters():,} parameters; {n_params:,} on this "
                      f"rank) dp={topo.dp} tp={topo.tp} pp={topo.pp}{cp} on {topo.device}; {len(trainer.data.train):,} "
                      f"training samples of {recipe.train.seq_len} tokens; global batch {res.global_batch}",
                      flush=True)
            if topo.world_size > 1:  # where each rank is: a collective that times out names who is missing
                trainer.progress = Progress(recipe.run.dir, topo.rank, topo.world_size)
            if recipe.sample.before and start_step == 0:  # the model as loaded: every rank decodes (tp collective)
                before = trainer.sample()
                if rank0 and before is not None:
                    print(f"sample before training:\n{before}", flush=True)
            try:
                if group is not None:  # a fault-tolerant replica group: steps from torchft's quorum
                    result = replica_fit(trainer, group, log, start_step, stop.requested,
                                         progress=rank0 and recipe.logging.progress)
                else:
                    result = trainer.fit(log=log, progress=rank0 and recipe.logging.progress, start_step=start_step,
                                         stop_requested=stop.requested)
            except Exception as err:
                # A peer killed mid-collective (SIGKILL, the OOM killer): name it, not gloo's "Connection reset".
                if trainer.progress is not None and (dead := trainer.progress.dead_peers(wait_s=2.0)):
                    raise JobStalled(trainer.progress.explain_dead(err, dead)) from err
                if trainer.progress is not None and is_collective_timeout(err):
                    raise JobStalled(trainer.progress.explain(err) + _last_collectives(recipe, topo)) from err
                if (diverged := diagnose_mismatch(err)) is not None:  # parallel.check_collectives caught it
                    raise JobStalled(diverged) from err
                raise
        finally:
            log.close()
    if group is not None and result.sample is None and result.stopped_at is None:
        result.sample = trainer.sample()  # every group samples (tp collective); rank 0 of each prints
    if rank0 and result.stopped_at is not None:
        print(f"megazoo: stopped by {stop.name or 'request'} after step {result.stopped_at}; checkpoint saved "
              f"under {Path(recipe.run.dir) / 'checkpoints'} (continue with --resume)", flush=True)
    elif rank0:
        if result.losses:
            first, last = result.losses[0], result.losses[-1]
            n = len(result.losses)
            print(f"train loss {first:.4f} -> {last:.4f} over {n} step{'s' if n != 1 else ''}")
        if result.val_loss is None:
            print("validation: no validation data (data.valid_paths is empty)")
        else:
            print(f"validation loss {result.val_loss:.4f}, perplexity {math.exp(min(result.val_loss, 50)):.2f}")
        if result.sample is not None:
            print(f"sample{' after training' if recipe.sample.before else ''}:\n{result.sample}")
        if result.checkpoint is not None:
            print(f"checkpoint: {result.checkpoint} (evaluate with megazoo eval --checkpoint, convert with "
                  f"megazoo convert megazoo-to-hf)")
        if result.checkpoint is not None and recipe.checkpoint.export_hf:  # the run's output, usable as is
            from megazoo.models.hf.convert_cli import export_run
            export_run(result.checkpoint, recipe.checkpoint.export_hf, lora=recipe.lora.enabled)
        print(f"metrics: {Path(recipe.run.dir) / 'metrics.jsonl'}", flush=True)
        if result.losses:
            curve = plot_runs({Path(recipe.run.dir).name: read_metrics(recipe.run.dir)},
                              Path(recipe.run.dir) / "loss.png")
            print(f"loss curve: {curve}", flush=True)
    return result


def _last_collectives(recipe, topo: Topology) -> str:
    """With parallel.flight_recorder: this rank's ring of recent collectives written beside the progress files,
    and every rank's last collective that arrived within a few seconds (peers time out a little later)."""
    if recipe.parallel.flight_recorder <= 0:
        return ""
    folder = Path(recipe.run.dir) / ".progress"
    dump_ring(folder, topo.rank, group_labels(topo))
    rings = read_rings(folder, topo.world_size, wait_s=min(10.0, recipe.parallel.timeout_s))
    return f". Last collectives (rings in {folder}): {diagnose(rings, topo.world_size)}"


class JobStalled(RuntimeError):
    """A collective timed out (the message names the operation and the ranks that did not arrive), ranks called
    different collectives (parallel.check_collectives: it names both ranks and calls), or a peer died (named)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megazoo.recipes.train", description="Train a megazoo recipe.")
    parser.add_argument("recipe", help="TOML recipe file")
    parser.add_argument("--data-dir", default=None, help="folder of the recipe's relative data paths")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe key (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, *, lock_held: bool = False) -> int:
    """torchrun entry point: reads the launcher's RANK / WORLD_SIZE / LOCAL_RANK (library code never does).
    Each process runs on GPU LOCAL_RANK when CUDA exists (NCCL), else on the CPU (gloo).

    Under torchrun the worker dies with torchrun (PR_SET_PDEATHSIG). Rank 0 holds run.dir's lock unless its
    launcher does (`lock_held`, or LOCK_HELD_ENV from `megazoo train`). Stopped by SIGTERM / SIGINT after saving,
    the exit status is 128 + signal (143 for SIGTERM), or 0 with the stop recorded for a `megazoo train` launcher
    (which then exits 143 itself: torchrun would report a non-zero worker as a failure)."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ and die_with_parent() and orphaned():
        print(f"megazoo: rank {rank}: torchrun is gone; not starting", file=sys.stderr)
        return 1
    try:
        recipe = load_recipe(find_recipe(args.recipe), args.overrides, data_dir=args.data_dir,  # a file or a name
                             catalog_dirs=default_folders(os.environ))  # catalog names: $MEGAZOO_DATA_DIR, cache
        recipe, group = replica_setup(recipe, os.environ)  # fault tolerance: this group's run.dir and lighthouse
        res = resolve(recipe, world_size=world_size)
        own_lock = rank == 0 and not lock_held and LOCK_HELD_ENV not in os.environ
        check_checkpoints(res.recipe.run.dir)
        if res.recipe.checkpoint.export_hf and rank == 0:  # refused now, not after training
            from megazoo.data.fileio import check_out_dir
            try:
                check_out_dir(res.recipe.checkpoint.export_hf)
            except ValueError:
                raise RecipeError(f"checkpoint.export_hf = {res.recipe.checkpoint.export_hf!r} exists and is not an "
                                  "empty folder: choose a new folder (an export never overwrites one)") from None
        lock = RunDirLock.acquire(res.recipe.run.dir) if own_lock else None  # held until this process ends
    except (RecipeError, RunDirBusy) as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    par, stop = res.recipe.parallel, GracefulStop()
    if world_size > 1:
        init_distributed(rank, world_size, local_rank=local_rank, init_method="env://", timeout_s=par.timeout_s,
                         check_collectives=par.check_collectives, flight_recorder=par.flight_recorder)
    try:
        # Processes per node: the recipe's, else the launcher's (torchrun sets LOCAL_WORLD_SIZE), read here only.
        node_size = par.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        layout = par if group is None else replace(par, dp=par.dp // group.groups)  # one replica group's ranks
        topo = Topology.solo(local_device(local_rank)) if world_size == 1 else Topology.of(layout, node_size=node_size)
        if world_size == 1:
            result = run(res, topo, stop, group)
        else:  # SIGUSR1 (from `megazoo train`, scancel --signal=USR1, kill): every rank writes its ring
            with RingDumpOnSignal(Path(res.recipe.run.dir) / ".progress", rank, world_size, group_labels(topo),
                                  recorder=par.flight_recorder > 0):
                result = run(res, topo, stop, group)
    except NoLiveGroup as err:  # nothing to rejoin: the run finished (or every other group is gone)
        print(f"megazoo: replica group {group.index if group else 0}: {err}", file=sys.stderr, flush=True)
        finish_worker(0)
    except LighthouseGone as err:  # saved at its last committed step: the launcher falls back to a whole restart
        print(f"megazoo: error (rank {rank}, replica group {group.index if group else 0}): {err}; the lighthouse is "
              "gone, so the groups cannot agree on steps: each group saved its last committed step, and the job "
              "falls back to the normal restart path (every group resumes from its latest checkpoint)",
              file=sys.stderr, flush=True)
        record_lighthouse_gone()
        finish_worker(LIGHTHOUSE_GONE_EXIT)
    except (CheckpointError, DataCacheError, JobStalled) as err:
        # A restart would only repeat these (a full disk, damaged checkpoints, a changed batch, a data cache that
        # cannot be written; a stalled peer is reported by every rank that waited for it): say so once, plainly,
        # and end the job.
        print(f"megazoo: error (rank {rank}): {err}", file=sys.stderr, flush=True)
        code = 1 if isinstance(err, JobStalled) else 2
        if code == 2:
            record_fatal()
        if world_size == 1:
            if lock is not None:
                lock.release()
            return code
        finish_worker(code)
    code = 0
    if result.stopped_at is not None:  # every rank stops together, even one the signal did not reach
        signum = stop.signum or signal.SIGTERM
        code = 0 if record_stop(signum) else 128 + signum
    if world_size == 1 and group is None:  # a replica group leaves by os._exit: torchft's threads would hold it
        if lock is not None:
            lock.release()
        return code
    finish_worker(code)  # barrier, destroy the group, flush, os._exit: torch 2.13 + gloo may abort at exit


if __name__ == "__main__":
    sys.exit(main())
