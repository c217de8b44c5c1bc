"""`megazoo preprocess --format sft`: instruction / chat rows -> an SFT dataset (tokens + loss mask + manifest).

    megazoo preprocess --format sft --input chat.jsonl --tokenizer hf:/path/tok --seq-len 2048 \\
        --output-prefix data/chat [--chat-template auto|tokenizer|chatml|llama3] [--bad-rows fail|skip]

Rows and templates: data/sft/examples.py, data/sft/chat_template.py. Bad rows (not JSON, a missing or mistyped field,
an unknown role, no assistant reply, more tokens than --seq-len) are all found in one pass and reported, one line
each with file:line and the reason. `--bad-rows fail` (the default) writes nothing and exits 2 with the whole
report; `--bad-rows skip` writes the good rows, prints the report and records it in PREFIX.sft.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megazoo.data.sft.chat_template import TEMPLATE_CHOICES, ChatTemplateError, chat_encoder, resolve_template
from megazoo.data.indexed.corpus_inputs import PreprocessError
from megazoo.data.sft.dataset import sft_paths, write_sft_dataset
from megazoo.data.sft.examples import read_examples, sft_input_kind
from megazoo.data.tokenizers.loading import load_tokenizer

BAD_ROW_POLICIES = ("fail", "skip")


class BadRowsError(PreprocessError):
    """Some rows cannot become examples; the message is the full report."""


def preprocess_sft(inputs, tokenizer, output_prefix, *, seq_len: int, template: str = "auto",
                   bad_rows: str = "fail", overwrite: bool = False, split: str = "train") -> dict:
    """Tokenize `inputs` into an SFT dataset at `output_prefix`; returns its manifest (with `seconds` added)."""
    if bad_rows not in BAD_ROW_POLICIES:
        raise PreprocessError(f"bad_rows {bad_rows!r} is invalid; valid: {', '.join(BAD_ROW_POLICIES)}")
    start = time.perf_counter()
    name, render = resolve_template(tokenizer, template)
    examples = read_examples(inputs, render, chat_encoder(tokenizer), seq_len, split=split)
    if examples.bad and bad_rows == "fail":
        raise BadRowsError(f"{examples.report()}\nnothing written; fix these rows, or pass --bad-rows skip to write "
                           f"the {len(examples.ids)} good ones and record the bad ones in the manifest")
    manifest = write_sft_dataset(examples, output_prefix, tokenizer.vocab_size, template=name, seq_len=seq_len,
                                 overwrite=overwrite)
    return {**manifest, "report": examples.report(), "seconds": time.perf_counter() - start}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The SFT flags of `megazoo preprocess` (data/indexed/preprocess.py registers the command)."""
    parser.add_argument("--format", choices=("text", "sft"), default="text",
                        help="text: documents for pretraining (default); sft: {prompt, response} or {messages} rows "
                             "for fine-tuning, tokens + a loss mask on the responses")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sft: the training sequence length; a longer example is a bad row (never truncated)")
    parser.add_argument("--chat-template", default="auto", choices=TEMPLATE_CHOICES,
                        help="sft: auto = the tokenizer's own (apply_chat_template), else name a built-in one")
    parser.add_argument("--bad-rows", default="fail", choices=BAD_ROW_POLICIES,
                        help="sft: fail (default) = write nothing and report every bad row; skip = write the good "
                             "rows and report (and record) the bad ones")


def run_sft_cli(args: argparse.Namespace) -> int:
    """`megazoo preprocess --format sft ...`: 0 on success, 2 with the error (the bad-row report) on bad input."""
    try:
        if args.seq_len is None:
            raise PreprocessError("--format sft needs --seq-len (the training sequence length; longer examples are "
                                  "reported, never truncated)")
        for path in args.input:
            sft_input_kind(Path(path))
        existing = [str(p) for p in sft_paths(args.output_prefix) if p.exists()]
        if existing and not args.overwrite:  # before loading the tokenizer: fail fast
            raise FileExistsError(f"output {' and '.join(existing)} already exists; pass --overwrite to replace it")
        tokenizer = load_tokenizer(args.tokenizer)
        result = preprocess_sft(args.input, tokenizer, args.output_prefix, seq_len=args.seq_len,
                                template=args.chat_template, bad_rows=args.bad_rows, overwrite=args.overwrite,
                                split=args.split)
    except (OSError, ValueError, ChatTemplateError) as error:
        print(f"megazoo preprocess: error: {error}", file=sys.stderr)
        return 2
    if result["report"]:
        print(f"megazoo preprocess: warning: skipped (--bad-rows skip) {result['report']}", file=sys.stderr)
    print(f"wrote SFT dataset {args.output_prefix} ({result['template']} template): {result['examples']:,} examples "
          f"of {result['rows']:,} rows, {result['tokens']:,} tokens, {result['response_tokens']:,} response tokens "
          f"in {result['seconds']:.1f} s")
    return 0
