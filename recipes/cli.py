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

# Light imports only (no torch): `megazoo --help` and every `megazoo CMD --help` must answer at once. A command's
# own module is imported when that command runs (COMMANDS below); train's checks import torch inside _train.
from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.training.run_dir import (LOCK_HELD_ENV, RunDirBusy, RunDirLock, check_checkpoints, move_aside,
                                              previous_run)
from megazoo.workers.supervisor import launch_local


def _train(args: argparse.Namespace) -> int:
    try:
        args.recipe = str(find_recipe(args.recipe))  # a file, or a shipped recipe's name (megazoo recipes)
        from megazoo.data.published.catalog import default_folders  # catalog names: $MEGAZOO_DATA_DIR, then the cache
        recipe = load_recipe(args.recipe, args.overrides, data_dir=args.data_dir,
                             catalog_dirs=default_folders(os.environ))
        par = recipe.parallel
        nproc = args.nproc if args.nproc is not None else par.dp * par.tp * par.pp * par.cp
        if nproc < 1:
            raise RecipeError(f"--nproc {nproc} is invalid: it must be a positive integer")
        from megazoo.recipes.resolve import resolve  # torch: imported once a command runs, not for --help
        resolve(recipe, world_size=nproc)
        if not args.overwrite:  # --overwrite moves everything aside, a stray file included
            check_checkpoints(recipe.run.dir)
        lock = RunDirLock.acquire(recipe.run.dir)  # one job per run.dir, held until this process ends
    except (RecipeError, RunDirBusy) as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    with lock:
        run_dir, resuming = Path(recipe.run.dir), args.resume or recipe.checkpoint.resume
        previous = previous_run(run_dir)
        start_over = args.overwrite or recipe.run.existing == "start_over"
        if previous and (args.overwrite or not resuming):
            if not start_over:
                print(f"megazoo: error: run.dir {run_dir} already holds a run ({', '.join(previous)}): continue "
                      f"it with --resume, or start over with --overwrite (moves the old files to "
                      f"{run_dir.name}.old-<time>/ beside it)", file=sys.stderr)
                return 2
            why = "--overwrite" if args.overwrite else "run.existing = 'start_over'"
            print(f"megazoo: starting over ({why}): moved the previous run in {run_dir} to {move_aside(run_dir)}",
                  file=sys.stderr)
        elif previous and resuming and (reason := _no_good_checkpoint(run_dir)):
            print(f"megazoo: error: {reason}", file=sys.stderr)  # before any worker starts: once, not per rank
            return 2
        if recipe.fault_tolerance.enabled:  # one torchrun per replica group, the lighthouse, group restarts
            return _train_replica_groups(args, recipe, nproc)
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
                            env={LOCK_HELD_ENV: f"{os.getpid()}@{socket.gethostname()}"}, ring_dump=True)


def _train_replica_groups(args: argparse.Namespace, recipe, nproc: int) -> int:
    """`[fault_tolerance]`: workers/replica_groups.py runs the lighthouse and each group's torchrun; a restarted group
    heals from a live one (so it does not resume from disk), a whole restart (the lighthouse lost) resumes."""
    from megazoo.workers.replica_groups import LighthouseSettings, launch_replica_groups
    ft = recipe.fault_tolerance
    resume = ["--set", "checkpoint.resume=true"]
    sets = [arg for text in args.overrides for arg in ("--set", text)] + (resume if args.resume else [])
    sets += ["--data-dir", args.data_dir] if args.data_dir else []
    settings = LighthouseSettings(ft.min_replicas, round(ft.join_timeout_s * 1000),
                                  round(ft.heartbeat_timeout_s * 1000))
    return launch_replica_groups(ft.replica_groups, nproc // ft.replica_groups, "megazoo.recipes.train",
                                 [args.recipe, *sets], lighthouse=ft.lighthouse, settings=settings,
                                 max_group_restarts=ft.max_group_restarts, resume_argv=resume,
                                 env={LOCK_HELD_ENV: f"{os.getpid()}@{socket.gethostname()}"})


def _no_good_checkpoint(run_dir: Path) -> str | None:
    """Why --resume cannot continue (run.dir's checkpoints are all damaged), in one line; None when one verifies
    or there is none. The launcher checks once, so N workers do not each print it and torchrun its summary; the
    cost is one more read of the latest checkpoint, whose sha256 the workers check again when they load it."""
    from megazoo.parallel.checkpoint.io import latest_good_checkpoint
    root, problems = run_dir / "checkpoints", []
    if latest_good_checkpoint(root, report=lambda *_: None, problems=problems) is not None or not problems:
        return None
    return (f"--resume: no good checkpoint under {root}, and nothing there was changed ({len(problems)} damaged; "
            f"the latest: {problems[0]}): repair or restore them, or use --overwrite to start over (the old run is "
            "moved aside)")


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
    from megazoo.models.presets import presets
    print(f"{'preset':<16}{'layers':>7}{'hidden':>8}{'heads':>6}{'positions':>10}{'vocab':>8}{'parameters':>18}"
          f"{'active (MoE)':>18}")
    for name, cfg in presets().items():
        active = f"{cfg.num_active_parameters():>18,}" if cfg.n_experts else ""  # the weights one token uses
        print(f"{name:<16}{cfg.n_layer:>7}{cfg.d_model:>8}{cfg.n_head:>6}{cfg.n_positions:>10}{cfg.vocab_size:>8,}"
              f"{cfg.num_parameters():>18,}{active}")
    print("\nparameters at each preset's own vocabulary (the embedding is vocab x hidden); a recipe that sets "
          "another one\n(model.vocab_size, or a tokenizer trained on its corpus, as the demo's) trains a different "
          "count, which\n`megazoo train` prints with the vocabulary it assumes")
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


def _plan(sub):
    from megazoo.recipes.planner.cli import register
    register(sub)


def _eval(sub):
    from megazoo.eval.cli import register
    register(sub)


def _generate(sub):
    from megazoo.recipes.generate_cli import register
    register(sub)


def _convert(sub):
    from megazoo.models.hf.convert_cli import register
    register(sub)


def _preprocess(sub):
    from megazoo.data.indexed.preprocess import register
    register(sub)


def _tokenizer(sub):
    from megazoo.data.tokenizers.cli import register
    register(sub)


def _launch(sub):
    from megazoo.recipes.launch.cli import register
    register(sub)


def _reproduce(sub):
    from megazoo.recipes.reproduce.cli import register
    register(sub)


def _plot(sub):
    from megazoo.recipes.training.plot import register
    register(sub)


def _verify(sub):
    from megazoo.recipes.verify.cli import register
    register(sub)


def _data(sub):
    from megazoo.data.published.fetch_cli import register
    from megazoo.recipes.sft_demo_cli import add_parser as sft_demo  # stdlib-only until it runs
    register(sub, more=(sft_demo,))


# The commands whose modules load on use: name -> (the line `megazoo --help` shows, which must be the help its
# module registers: tests/recipes/test_cli.py holds them equal, and the function that registers it).
COMMANDS = {
    "plan": ("ZeRO memory and communication plan per device", _plan),
    "eval": ("zero-shot WikiText-103 perplexity / LAMBADA accuracy; lm-eval tasks", _eval),
    "generate": ("continue a prompt with a checkpoint's model (KV cache)", _generate),
    "convert": ("convert checkpoints between Hugging Face (GPT-2, Llama, Qwen2, Mistral) and megazoo", _convert),
    "preprocess": ("tokenize jsonl/txt/parquet/datasets inputs into an indexed dataset (PREFIX.bin + .idx)",
                   _preprocess),
    "tokenizer": ("train a tokenizer on your corpus (bpe or sentencepiece)", _tokenizer),
    "launch": ("launch one node of a multi-node job (torchrun), or write a Slurm sbatch script (--slurm)", _launch),
    "reproduce": ("regenerate a published table (markdown + plot)", _reproduce),
    "plot": ("plot loss, lr, tokens/s and memory of runs (metrics.jsonl)", _plot),
    "data": ("fetch the published evaluation data and GPT-2 vocabulary; build the SFT demo's dataset", _data),
    "verify": ("check that a recipe's parallel layout computes the same function as one process (shrunk, fp64, on "
               "this machine)", _verify),
}


def _command_in(argv: list[str]) -> str | None:
    """The subcommand argv names (its first word that is not an option), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `megazoo` parser. With `command`, only that command's module is imported (the others are listed by
    name and help); without one, every command's full parser is built."""
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
    for name, (text, register) in COMMANDS.items():
        if command is None or name == command:  # the command that runs, or every one for an unknown name
            register(sub)
        else:  # listed by `megazoo --help`; its module (and torch) loads only when it runs
            sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_in(argv)
    args = build_parser(command if command in COMMANDS or command in ("train", "presets", "recipes") else
                        "").parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `megazoo presets | head`: the reader left early, which is not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 141  # 128 + SIGPIPE, as a shell pipeline reports it


if __name__ == "__main__":
    sys.exit(main())
