"""`megazoo eval` and `megazoo convert` called in-process, as the command table wires them."""

from __future__ import annotations

import argparse

from megazoo.eval.cli import register as register_eval
from megazoo.models.hf.convert_cli import register as register_convert


def megazoo(argv) -> int:
    """The `megazoo` command with the two subcommands this work adds (recipes/cli.py wires the same)."""
    parser = argparse.ArgumentParser(prog="megazoo")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_eval(subparsers)
    register_convert(subparsers)
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)
