"""The training entry point: `python -m megazoo.recipes.train RECIPE.toml [--set k=v ...]`, one process per rank.

`megazoo train` checks the recipe and launches this under torchrun (or runs it in place for one process); the
loop itself is recipes/trainer.py. This module reads the launcher's RANK / WORLD_SIZE, builds the Topology,
restores a checkpoint when asked, handles SIGTERM (preemption: finish the step, save, stop) and prints the
run's summary on rank 0.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path

from megazoo.parallel.local_launch import finish_worker
from megazoo.parallel.topology import Topology, init_distributed, local_device
from megazoo.recipes import checkpointing
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.metrics import MetricsLog
from megazoo.recipes.resolve import Resolved, resolve
from megazoo.recipes.trainer import Trainer, TrainResult


def run(res: Resolved, topo: Topology) -> TrainResult:
    """Train as the recipe says, log on rank 0, and print the closing summary there."""
    rank0 = topo.rank == 0
    recipe = res.recipe
    log = MetricsLog(recipe.run.dir, enabled=rank0, wandb_mode=recipe.logging.wandb,
                     project=recipe.logging.wandb_project, config=recipe.to_dict())
    trainer = Trainer(res, topo)
    if rank0:
        print("\n".join(trainer.kernels.describe()), flush=True)
    start_step = checkpointing.restore(trainer, report=print if rank0 else (lambda *_: None))
    if rank0:
        n_params = sum(p.numel() for p in trainer.model.parameters())
        print(f"megazoo: {res.model.name} ({res.model.num_parameters():,} parameters; {n_params:,} on this rank) "
              f"dp={topo.dp} tp={topo.tp} pp={topo.pp} on {topo.device}; {len(trainer.data.train):,} training "
              f"samples of {recipe.train.seq_len} tokens; global batch {res.global_batch}", flush=True)
    # Preemption: SIGTERM lets the current step finish, then every rank saves a checkpoint and stops.
    terminated = {"flag": False}

    def on_sigterm(*_):
        terminated["flag"] = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM (e.g. the launcher giving up) kills

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = trainer.fit(log=log, progress=rank0 and recipe.logging.progress, start_step=start_step,
                             stop_requested=lambda: terminated["flag"])
    finally:
        signal.signal(signal.SIGTERM, previous)
        log.close()
    if rank0 and result.stopped_at is not None:
        print(f"megazoo: stopped by SIGTERM after step {result.stopped_at}; checkpoint saved under "
              f"{Path(recipe.run.dir) / 'checkpoints'} (continue with --resume)", flush=True)
    elif rank0:
        if result.losses:
            first, last = result.losses[0], result.losses[-1]
            print(f"train loss {first:.4f} -> {last:.4f} over {len(result.losses)} steps")
        if result.val_loss is None:
            print("validation: no validation data (data.valid_paths is empty)")
        else:
            print(f"validation loss {result.val_loss:.4f}, perplexity {math.exp(min(result.val_loss, 50)):.2f}")
        if result.sample is not None:
            print(f"sample:\n{result.sample}")
        print(f"metrics: {Path(recipe.run.dir) / 'metrics.jsonl'}", flush=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megazoo.recipes.train", description="Train a megazoo recipe.")
    parser.add_argument("recipe", help="TOML recipe file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe key (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: reads the launcher's RANK / WORLD_SIZE / LOCAL_RANK (library code never does).
    Each process runs on GPU LOCAL_RANK when CUDA exists (NCCL), else on the CPU (gloo)."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        res = resolve(load_recipe(args.recipe, args.overrides), world_size=world_size)
    except RecipeError as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    par = res.recipe.parallel
    if world_size == 1:
        run(res, Topology.solo(local_device(local_rank)))
        return 0
    init_distributed(rank, world_size, local_rank=local_rank, init_method="env://", timeout_s=par.timeout_s)
    run(res, Topology.build(par.dp, par.tp, par.pp))
    finish_worker(0)  # barrier, destroy the group, flush, os._exit: torch 2.13 + gloo may abort at exit


if __name__ == "__main__":
    sys.exit(main())
