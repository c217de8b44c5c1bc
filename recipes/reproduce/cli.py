"""`megazoo reproduce NAME --out DIR`: regenerate a published table beside our planner / measurements.

    megazoo reproduce zero-memory --out docs/        # ZeRO Table 1 (planner) + model states measured at dp 2, 4
    megazoo reproduce zero-scale --out out/ [--quick]   # largest GPT per ZeRO stage on 4 local ranks
    megazoo reproduce claims --out out/              # T-NLG, ZeRO-100B, 3D 1T, GPT-2 1.5B claims recomputed
    megazoo reproduce eval --out out/ --weights gpt2-1.5b=DIR [NAME=DIR ...] [--limit N]
    megazoo reproduce pipeline-bubble --out out/ [--quick]

Each writes DIR/NAME.md (the tables, with the source of every published number), DIR/NAME.png (matplotlib,
headless) and DIR/NAME.json (the numbers). Exit 0; 2 on bad input (a message naming it). The modules:
recipes/reproduce/zero.py, reproduce_claims.py, reproduce_eval.py (eval, pipeline-bubble). recipes/cli.py wires
`register(subparsers)` in; `main(argv)` runs it alone (`python -m megazoo.recipes.reproduce.cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megazoo.data.published.catalog import fetch_folder
from megazoo.recipes.reproduce.common import Report, ReproduceError, save_figure


def _zero_memory(args) -> Report:
    from megazoo.recipes.reproduce.zero import zero_memory
    return zero_memory(args)


def _zero_scale(args) -> Report:
    from megazoo.recipes.reproduce.zero import zero_scale
    return zero_scale(args)


def _claims(args) -> Report:
    from megazoo.recipes.reproduce.claims import claims
    return claims(args)


def _eval(args) -> Report:
    from megazoo.recipes.reproduce.eval_tables import eval_table
    return eval_table(args)


def _pipeline(args) -> Report:
    from megazoo.recipes.reproduce.eval_tables import pipeline_bubble
    return pipeline_bubble(args)


NAMES = {"zero-memory": _zero_memory, "zero-scale": _zero_scale, "claims": _claims, "eval": _eval,
         "pipeline-bubble": _pipeline}


def run(args: argparse.Namespace) -> int:
    if args.name not in NAMES:  # argparse's choices say it too; main() callers may pass a Namespace directly
        print(f"megazoo reproduce: error: unknown table {args.name!r}; valid: {', '.join(NAMES)}", file=sys.stderr)
        return 2
    args.report = lambda text: print(text, file=sys.stderr, flush=True)
    out = Path(args.out)
    if getattr(args, "data_dir", None) is None:  # where `megazoo data fetch` stores (data/published/catalog.py)
        args.data_dir = str(fetch_folder(os.environ))
    try:
        if out.exists() and not out.is_dir():
            raise ReproduceError(f"--out {out} is a file; give a directory (created when missing)")
        if args.weights and args.name != "eval":
            raise ReproduceError(f"--weights is for `reproduce eval`, not {args.name}")
        rep = NAMES[args.name](args)
    except ReproduceError as err:
        print(f"megazoo reproduce: error: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    md, png, js = (out / f"{args.name}.{ext}" for ext in ("md", "png", "json"))
    md.write_text(rep.markdown())
    js.write_text(json.dumps(rep.data, indent=1, default=str) + "\n")
    if rep.figure is not None:
        save_figure(rep.figure, png)
    print(rep.markdown())
    print(f"wrote {md}, {png}, {js}", file=sys.stderr)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=list(NAMES), help="the table to reproduce")
    parser.add_argument("--out", required=True, metavar="DIR", help="write DIR/NAME.md, DIR/NAME.png, DIR/NAME.json")
    parser.add_argument("--quick", action="store_true",
                        help="zero-scale / pipeline-bubble: a short version (tiny search space, fewer steps)")
    parser.add_argument("--weights", nargs="+", default=[], metavar="NAME=DIR",
                        help="eval: model weights to score, NAME (e.g. gpt2-1.5b, picks the published row) = a Hugging "
                             "Face GPT-2 directory or a megazoo checkpoint")
    parser.add_argument("--data-dir", default=None,
                        help="eval: folder with wikitext103/wiki.test.tokens, lambada/lambada_test.jsonl and "
                             "gpt2_bpe/ (default: $MEGAZOO_DATA_DIR, else the cache folder `megazoo data fetch all` "
                             "fills)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="eval: tokenizer of the weights (default: the weights dir if it has one, else "
                             "DATA_DIR/gpt2_bpe)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="eval: score only the first N windows / examples (a quick check, not the published "
                             "protocol)")
    parser.add_argument("--batch-size", type=int, default=4, help="eval: windows / examples per forward")


def register(subparsers) -> argparse.ArgumentParser:
    """Add `reproduce` to the `megazoo` subcommands; its func returns the exit code."""
    parser = subparsers.add_parser("reproduce", help="regenerate a published table (markdown + plot)",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megazoo reproduce", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
