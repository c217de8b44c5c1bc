"""The `megazoo` command line: `megazoo train RECIPE [--set k=v ...] [--nproc N]`, `megazoo presets`,
`megazoo plan ...` (ZeRO memory and communication planner), `megazoo eval wikitext103|lambada ...`,
`megazoo convert hf-to-megazoo|megazoo-to-hf ...`, `megazoo preprocess ...` (indexed datasets),
`megazoo tokenizer train ...` (BPE or sentencepiece on a user corpus).

`train` checks the recipe (and that dp x tp x pp matches the process count) before any process starts, then
runs one process in place or N local processes through torchrun (`python -m torch.distributed.run`).
"""

from __future__ import annotations

import argparse
import sys

from megazoo.data.preprocess import register as register_preprocess
from megazoo.data.tokenizer_cli import register as register_tokenizer
from megazoo.eval.cli import register as register_eval
from megazoo.models.gpt2.convert_cli import register as register_convert
from megazoo.parallel.local_launch import launch_local
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.plan_cli import register as register_plan
from megazoo.recipes.resolve import resolve


def _train(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        par = recipe.parallel
        nproc = args.nproc if args.nproc is not None else par.dp * par.tp * par.pp
        if nproc < 1:
            raise RecipeError(f"--nproc {nproc} is invalid: it must be a positive integer")
        resolve(recipe, world_size=nproc)
    except RecipeError as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    overrides = list(args.overrides)
    if args.resume or args.max_restarts:  # a restarted job must continue from its latest good checkpoint
        overrides.append("checkpoint.resume=true")
    sets = [arg for text in overrides for arg in ("--set", text)]
    if nproc == 1 and not args.max_restarts:
        from megazoo.recipes.train import main as train_main
        return train_main([args.recipe, *sets])
    # Restarts: a failed job (a rank died, a collective timed out) is started again, every worker, and resumes
    # from the latest good checkpoint (checkpoint.resume=true above).
    return launch_local(nproc, "megazoo.recipes.train", [args.recipe, *sets], max_restarts=args.max_restarts,
                        restart_note=" from the latest good checkpoint")


def _presets(args: argparse.Namespace) -> int:
    from megazoo.models.config import presets
    print(f"{'preset':<16}{'layers':>7}{'hidden':>8}{'heads':>6}{'positions':>10}{'parameters':>18}")
    for name, cfg in presets().items():
        print(f"{name:<16}{cfg.n_layer:>7}{cfg.d_model:>8}{cfg.n_head:>6}{cfg.n_positions:>10}"
              f"{cfg.num_parameters():>18,}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megazoo", description="Giant GPT training recipes on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a recipe (TOML)")
    train.add_argument("recipe", help="recipe file, e.g. recipes/demo.toml")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a recipe key, e.g. --set train.steps=20 (repeatable)")
    train.add_argument("--nproc", type=int, default=None,
                       help="local processes to start (default: dp x tp x pp from the recipe)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest good checkpoint in run.dir (resharding if the layout changed)")
    train.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="restart all workers up to N times after a failure, resuming from the latest checkpoint")
    train.set_defaults(func=_train)
    listing = sub.add_parser("presets", help="list the model presets and their parameter counts")
    listing.set_defaults(func=_presets)
    register_plan(sub)
    register_eval(sub)
    register_convert(sub)
    register_preprocess(sub)
    register_tokenizer(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
