"""`megazoo data sft-demo --checkpoint CKPT | --tokenizer TOK --output-prefix PREFIX [--seq-len N]`: the SFT demo's
dataset (recipes/sft-demo.toml), built on any machine from the Python standard library in one command.

Rows come from data/sft/stdlib_sft.py (prompt = a documented stdlib function's docstring, response = its signature),
go to PREFIX.jsonl, and are tokenized through the chat template into an SFT dataset at PREFIX (tokens + loss mask
+ manifest, as `megazoo preprocess --format sft` writes it). The tokenizer is the checkpoint's own (the one its
model was trained with, copied to PREFIX.tokenizer.json for the recipe's data.tokenizer) or --tokenizer. Rows
longer than --seq-len are left out and counted (their file:line reasons are recorded in PREFIX.sft.json), never
truncated. Exit status: 0 written, 2 bad arguments (one line naming the value; nothing written). Imports only the
standard library up front, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "build the SFT demo's dataset (stdlib docstrings -> signatures) through a chat template"


def _tokenizer(args: argparse.Namespace):
    """(the tokenizer, the spec a recipe's data.tokenizer names it by)."""
    from megazoo.data.tokenizers.tokenizer import BPETokenizer
    from megazoo.data.tokenizers.loading import load_tokenizer
    from megazoo.models.loading import open_checkpoint

    if args.tokenizer:
        return load_tokenizer(args.tokenizer), args.tokenizer
    # FileNotFoundError naming the path when it holds no checkpoint, or when the checkpoint records no tokenizer
    ckpt = open_checkpoint(args.checkpoint, report=lambda line: print(line, file=sys.stderr))
    if not isinstance(ckpt.tokenizer, BPETokenizer):
        raise ValueError(f"the tokenizer of checkpoint {ckpt.path} is a {type(ckpt.tokenizer).__name__}, which "
                         "cannot be copied to a file here; pass --tokenizer with its spec instead")
    saved = Path(f"{args.output_prefix}.tokenizer.json")
    saved.parent.mkdir(parents=True, exist_ok=True)
    ckpt.tokenizer.save(saved)
    return ckpt.tokenizer, str(saved)


def _check(args: argparse.Namespace) -> None:
    """Every argument checked before anything is read or written."""
    for flag, value in (("--seq-len", args.seq_len), ("--max-bytes", args.max_bytes),
                        ("--max-doc-chars", args.max_doc_chars)):
        if value < 1:
            raise ValueError(f"{flag} {value} is invalid: it must be a positive integer")
    if args.checkpoint and not Path(args.checkpoint).exists():
        raise FileNotFoundError(f"--checkpoint {args.checkpoint} does not exist: give a run's checkpoints/ folder "
                                "(e.g. runs/demo/checkpoints after `make demo`) or one step_N directory")
    from megazoo.data.sft.dataset import sft_paths

    existing = [str(p) for p in sft_paths(args.output_prefix) if p.exists()]
    if existing and not args.overwrite:
        raise FileExistsError(f"output {' and '.join(existing)} already exists; pass --overwrite to replace it")


def _run(args: argparse.Namespace) -> int:
    try:
        _check(args)
        from megazoo.data.sft.preprocess import preprocess_sft
        from megazoo.data.sft.stdlib_sft import stdlib_sft_rows, write_rows

        tokenizer, spec = _tokenizer(args)
        rows, _ = stdlib_sft_rows(args.max_bytes, args.max_doc_chars)
        jsonl = Path(f"{args.output_prefix}.jsonl")
        write_rows(rows, jsonl)
        result = preprocess_sft([jsonl], tokenizer, args.output_prefix, seq_len=args.seq_len,
                                template=args.chat_template, bad_rows="skip", overwrite=args.overwrite)
    except (OSError, ValueError) as error:  # a ChatTemplateError is a ValueError
        print(f"megazoo data sft-demo: error: {error}", file=sys.stderr)
        return 2
    left_out = result["rows"] - result["examples"]
    print(f"wrote SFT dataset {args.output_prefix} ({result['template']} template): {result['examples']:,} of "
          f"{result['rows']:,} stdlib functions ({left_out:,} longer than --seq-len {args.seq_len} left out, "
          f"listed in {args.output_prefix}.sft.json), {result['tokens']:,} tokens, {result['response_tokens']:,} "
          f"response tokens in {result['seconds']:.1f} s")
    print(f"tokenizer: {spec} (the recipe's data.tokenizer); rows: {jsonl}")
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    """`sft-demo` under `megazoo data`."""
    parser = sub.add_parser("sft-demo", help=HELP, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", default=None, metavar="CKPT",
                        help="the base model's checkpoints/ folder or step_N directory: its tokenizer is used "
                             "(e.g. runs/demo/checkpoints after `make demo`)")
    source.add_argument("--tokenizer", default=None, metavar="TOK",
                        help="a tokenizer spec instead (a GPT-2 BPE folder, a tokenizer .json, hf:NAME)")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="where the dataset goes (PREFIX.bin/.idx, PREFIX.lossmask.*, PREFIX.sft.json, "
                             "PREFIX.jsonl)")
    parser.add_argument("--seq-len", type=int, default=128,
                        help="the fine-tuning sequence length; longer rows are left out (default 128)")
    parser.add_argument("--chat-template", default="chatml", choices=("chatml", "llama3", "tokenizer"),
                        help="the template rows are rendered in (default chatml)")
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="stdlib source bytes to read")
    parser.add_argument("--max-doc-chars", type=int, default=1500, help="skip longer docstrings")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset at PREFIX")
    parser.set_defaults(func=_run)
    return parser
