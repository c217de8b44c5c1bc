"""The `megazoo` command line: `megazoo train RECIPE|NAME [--set k=v ...] [--data-dir DIR] [--nproc N]`,
`megazoo recipes` (the shipped recipes, by NAME), `megazoo presets`,
`megazoo plan ...` (ZeRO memory and communication planner), `megazoo eval wikitext103|lambada ...`,
`megazoo convert hf-to-megazoo|megazoo-to-hf ...`, `megazoo preprocess ...` (indexed datasets),
`megazoo tokenizer train ...` (BPE or sentencepiece on a user corpus), `megazoo launch ...` (one node of a
multi-node job, or a Slurm sbatch script), `megazoo reproduce NAME --out DIR` (published tables, with plots),
`megazoo plot RUN_DIR ... --out FILE.png` (a run's curves), `megazoo generate CKPT --prompt TEXT ...` (text),
`megazoo verify RECIPE|NAME` (the recipe's layout, shrunk, held to one process in fp64).

`train` checks the recipe (and that dp x tp x pp matches the process count) before any process starts, takes
run.dir's lock (one job per run.dir; exit 2 naming the holder), refuses a fresh run into a run.dir that holds a
run (exit 2; --resume or --overwrite), then runs one process in place or N local processes through torchrun
(`python -m torch.distributed.run`). SIGTERM / SIGINT stop the job with a checkpoint and exit status 143 / 130.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from megazoo.data.preprocess import register as register_preprocess
from megazoo.data.tokenizer_cli import register as register_tokenizer
from megazoo.eval.cli import register as register_eval
from megazoo.models.gpt2.convert_cli import register as register_convert
from megazoo.workers.supervisor import launch_local
from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.generate_cli import register as register_generate
from megazoo.recipes.launch.cli import register as register_launch
from megazoo.recipes.planner.cli import register as register_plan
from megazoo.recipes.training.plot import register as register_plot
from megazoo.recipes.reproduce.cli import register as register_reproduce
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.run_dir import LOCK_HELD_ENV, RunDirBusy, RunDirLock, move_aside, previous_run
from megazoo.recipes.verify.cli import register as register_verify


def _train(args: argparse.Namespace) -> int:
    try:
        args.recipe = str(find_recipe(args.recipe))  # a file, or a shipped recipe's name (megazoo recipes)
        recipe = load_recipe(args.recipe, args.overrides, data_dir=args.data_dir)
        par = recipe.parallel
        nproc = args.nproc if args.nproc is not None else par.dp * par.tp * par.pp * par.cp
        if nproc < 1:
            raise RecipeError(f"--nproc {nproc} is invalid: it must be a positive integer")
        resolve(recipe, world_size=nproc)
        lock = RunDirLock.acquire(recipe.run.dir)  # one job per run.dir, held until this process ends
    except (RecipeError, RunDirBusy) as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    with lock:
        run_dir, resuming = Path(recipe.run.dir), args.resume or recipe.checkpoint.resume
        previous = previous_run(run_dir)
        if previous and (args.overwrite or not resuming):
            if not args.overwrite:
                print(f"megazoo: error: run.dir {run_dir} already holds a run ({', '.join(previous)}): continue "
                      f"it with --resume, or start over with --overwrite (moves the old files to "
                      f"{run_dir.name}.old-<time>/ beside it)", file=sys.stderr)
                return 2
            print(f"megazoo: moved the previous run in {run_dir} to {move_aside(run_dir)}", file=sys.stderr)
        overrides = list(args.overrides)
        if args.resume or args.max_restarts:  # a restarted job must continue from its latest good checkpoint
            overrides.append("checkpoint.resume=true")
        sets = [arg for text in overrides for arg in ("--set", text)]
        sets += ["--data-dir", args.data_dir] if args.data_dir else []
        if nproc == 1 and not args.max_restarts:
            from megazoo.recipes.train import main as train_main
            return train_main([args.recipe, *sets], lock_held=True)
        # Restarts: a failed job (a rank died, a collective timed out) is started again, every worker, and
        # resumes from the latest good checkpoint (checkpoint.resume=true above); a stop by signal ends the job.
        return launch_local(nproc, "megazoo.recipes.train", [args.recipe, *sets], max_restarts=args.max_restarts,
                            restart_note=" from the latest good checkpoint",
                            env={LOCK_HELD_ENV: f"{os.getpid()}@{socket.gethostname()}"})


def _restarts(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: it must be 0 (no restarts, the default) or a "
                                         f"positive number of restarts")
    return value


def _presets(args: argparse.Namespace) -> int:
    from megazoo.models.config import presets
    print(f"{'preset':<16}{'layers':>7}{'hidden':>8}{'heads':>6}{'positions':>10}{'parameters':>18}")
    for name, cfg in presets().items():
        print(f"{name:<16}{cfg.n_layer:>7}{cfg.d_model:>8}{cfg.n_head:>6}{cfg.n_positions:>10}"
              f"{cfg.num_parameters():>18,}")
    return 0


def _recipes(args: argparse.Namespace) -> int:
    from megazoo.recipes.catalog import describe, shipped_recipes
    found = shipped_recipes()
    width = max(map(len, found), default=0) + 2
    for name, path in found.items():
        print(f"{name:<{width}}{describe(path)}")
    print(f"\n{len(found)} recipes in {next(iter(found.values())).parent if found else '(none)'}; train one with "
          "`megazoo train NAME`, copy one to change it")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("megazoo")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megazoo", description="Giant GPT training recipes on PyTorch.")
    parser.add_argument("--version", action="version", version=f"megazoo {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a recipe (TOML)")
    train.add_argument("recipe", help="recipe file (e.g. my.toml) or a shipped recipe's name (e.g. demo; see "
                                      "`megazoo recipes`)")
    train.add_argument("--data-dir", default=None, metavar="DIR",
                       help="folder the recipe's relative data paths (data.paths, data.valid_paths, "
                            "data.tokenizer) are in (default: the recipe file's folder, then the current one)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a recipe key, e.g. --set train.steps=20 (repeatable)")
    train.add_argument("--nproc", type=int, default=None,
                       help="local processes to start (default: dp x tp x pp from the recipe)")
    fresh = train.add_mutually_exclusive_group()
    fresh.add_argument("--resume", action="store_true",
                       help="continue from the latest good checkpoint in run.dir (resharding if the layout changed)")
    fresh.add_argument("--overwrite", action="store_true",
                       help="start over in a run.dir that holds a run: its files move to RUN_DIR.old-<time>/")
    train.add_argument("--max-restarts", type=_restarts, default=0, metavar="N",
                       help="restart all workers up to N times after a failure (not after a stop by SIGTERM / "
                            "SIGINT), resuming from the latest checkpoint")
    train.set_defaults(func=_train)
    listing = sub.add_parser("presets", help="list the model presets and their parameter counts")
    listing.set_defaults(func=_presets)
    shipped = sub.add_parser("recipes", help="list the shipped recipes (train one with `megazoo train NAME`)")
    shipped.set_defaults(func=_recipes)
    register_plan(sub)
    register_eval(sub)
    register_generate(sub)
    register_convert(sub)
    register_preprocess(sub)
    register_tokenizer(sub)
    register_launch(sub)
    register_reproduce(sub)
    register_plot(sub)
    register_verify(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
