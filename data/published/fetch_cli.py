"""`megazoo data fetch wikitext103|lambada|gpt2-bpe|all [--dir DIR] [--mirror URL]`: the published evaluation data
and GPT-2 vocabulary, checked against their published SHA-256 (data/published/catalog.py), stored where recipes and tests
look for them.

Without --dir the files go to $MEGAZOO_DATA_DIR, else the user cache folder ($XDG_CACHE_HOME/megazoo/data, else
~/.cache/megazoo/data); a recipe's `data.tokenizer = "gpt2-bpe"` and the test suite find them there. Exit status:
0 stored (or already present and intact), 1 a download failed or did not match its hash (nothing stored for that
file), 2 bad arguments, 130 / 143 stopped by Ctrl-C / SIGTERM (no partial file is left). Imports only the
standard library up front, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from megazoo.data.published.catalog import CATALOG, fetch_folder


class _Terminated(BaseException):
    """SIGTERM during a fetch, raised in the main thread so every temporary file is removed on the way out
    (a BaseException: no `except Exception` on the way may swallow it)."""


def _raise_terminated(signum, frame):
    raise _Terminated


def _fetch(args: argparse.Namespace) -> int:
    from megazoo.data.published.fetch import FetchError, fetch_item, item_names

    try:
        names = item_names(args.name)
    except FetchError as err:
        print(f"megazoo data fetch: error: {err}", file=sys.stderr)
        return 2
    folder = Path(args.dir) if args.dir else fetch_folder(os.environ)
    log = (lambda line: print(line, file=sys.stderr))
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    failed, hosts = [], {}  # hosts: the unreachable ones of each failed item (none: a failure of another kind)
    try:
        for name in names:
            try:
                place = fetch_item(CATALOG[name], folder, base_url=args.mirror, progress=sys.stderr.isatty(),
                                   log=log)
                print(f"{name}: {place}")
            except (FetchError, OSError) as err:
                print(f"megazoo data fetch: error: {name}: {err}", file=sys.stderr)
                failed.append(name)
                hosts[name] = getattr(err, "unreachable", ())
    except KeyboardInterrupt:
        print("megazoo data fetch: stopped by Ctrl-C; no partial file was left", file=sys.stderr)
        return 130
    except _Terminated:
        print("megazoo data fetch: stopped by SIGTERM; no partial file was left", file=sys.stderr)
        return 143
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if failed:
        print(_failure_summary(failed, hosts, [n for n in names if n not in failed]), file=sys.stderr)
        return 1
    print(f"data in {folder}: recipes (data.tokenizer = \"gpt2-bpe\") and the tests look there" if not args.dir
          else f"data in {folder}: use it with --data-dir {folder} or MEGAZOO_DATA_DIR={folder}", file=sys.stderr)
    return 0


def _failure_summary(failed: list[str], hosts: dict[str, tuple[str, ...]], stored: list[str]) -> str:
    """The closing line of a failed fetch: what was not stored and why in one phrase; with no network, the ways
    to get the data without one."""
    done = f" ({', '.join(stored)} stored and checked)" if stored else ""
    if all(hosts[name] for name in failed):
        unreachable = ", ".join(dict.fromkeys(h for name in failed for h in hosts[name]))
        return (f"megazoo data fetch: {', '.join(failed)} not stored: no network (could not reach {unreachable})"
                f"{done}. Without a network, use a copy of a data folder (from a machine that fetched it): "
                "fetch from it with --mirror URL (http://HOST/PATH, or file:///PATH), or use it where it is with "
                "MEGAZOO_DATA_DIR=PATH (recipes and tests look there; `megazoo data fetch NAME --dir PATH` checks "
                "its hashes). Nothing partial was stored.")
    return (f"megazoo data fetch: {', '.join(failed)} not stored: the errors above say why{done}; nothing partial "
            "was stored")


def add_arguments(parser: argparse.ArgumentParser, more=()) -> None:
    """`fetch`, then each of `more` (functions adding a subcommand: recipes/cli.py passes `sft-demo`)."""
    sub = parser.add_subparsers(dest="data_command", required=True)
    fetch = sub.add_parser("fetch", help="download published data, checked against its sha256",
                           description=__doc__.split("\n\n")[0])
    fetch.add_argument("name", choices=[*CATALOG, "all"],
                       help="; ".join(f"{item.name}: {item.what}" for item in CATALOG.values()) + "; all: every one")
    fetch.add_argument("--dir", default=None, metavar="DIR",
                       help="data folder to store into (default: $MEGAZOO_DATA_DIR, else $XDG_CACHE_HOME/megazoo/data "
                            "or ~/.cache/megazoo/data)")
    fetch.add_argument("--mirror", default=None, metavar="URL",
                       help="download from URL/FOLDER/FILE (a copy laid out like a data folder, e.g. "
                            "URL/gpt2_bpe/encoder.json; http:// or file:///PATH) instead of the published sources: "
                            "the way to fetch without a network")
    fetch.set_defaults(func=_fetch)
    for add in more:  # `megazoo data sft-demo` (recipes/sft_demo_cli.py: it reads a checkpoint, above data/)
        add(sub)


def register(subparsers, more=()) -> argparse.ArgumentParser:
    """Add `data` (fetch, sft-demo) to the `megazoo` subcommands; its func returns the exit code."""
    parser = subparsers.add_parser("data", help="fetch the published evaluation data and GPT-2 vocabulary; build "
                                                "the SFT demo's dataset",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser, more)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megazoo data", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
