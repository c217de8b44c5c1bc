"""Train a tokenizer on a user corpus: `megazoo tokenizer train ...` (or `python -m megazoo.data.tokenizers.cli train ...`).

    megazoo tokenizer train --input corpus.jsonl more.txt --type bpe --vocab-size 32000 --output tok/corpus
    -> tok/corpus.json          (byte-level BPE, `tokenizers`; load with --tokenizer tok/corpus.json)
    megazoo tokenizer train --input corpus.jsonl --type sentencepiece --vocab-size 32000 --output tok/corpus
    -> tok/corpus.model + .vocab (sentencepiece, lossless; load with --tokenizer tok/corpus.model)

Inputs are read as `megazoo preprocess` reads them: `.jsonl`/`.json` one {"text": ...} object per line (the
field is `--text-key`; a line without it stops the run naming file:line), `.txt` plain text. They are
streamed (both trainers take an iterator), so memory does not grow with the corpus on our side. An existing
output is never overwritten, and nothing is written unless training succeeds. Exit code 0, or 2 with one
`error:` line on bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from megazoo.data.indexed.preprocess import PreprocessError, check_inputs, parse_record
from megazoo.data.fileio import write_new_file
from megazoo.data.tokenizers.tokenizer import EOD_TOKEN, BPETokenizer, Tokenizer

KINDS = ("bpe", "sentencepiece")
TEXT_BLOCK_CHARS = 1 << 20  # a .txt file reaches the trainer in blocks of whole lines of about this size


def output_files(kind: str, output: str | Path) -> list[Path]:
    """The files `train_tokenizer` writes: OUTPUT(.json) for bpe, OUTPUT.model + OUTPUT.vocab for sentencepiece."""
    output = Path(output)
    if kind == "bpe":
        return [output if output.suffix == ".json" else output.with_name(output.name + ".json")]
    from megazoo.data.tokenizers.sentencepiece_tokenizer import output_paths

    return list(output_paths(output))


def iter_texts(paths: list[Path], text_key: str = "text", bar: tqdm | None = None) -> Iterator[str]:
    """The texts of every input in order, read one line at a time: each jsonl document, and each .txt file
    in blocks of whole lines (newlines kept, so the BPE trainer can learn tokens for them)."""
    for path in paths:
        with open(path, "rb") as f:
            if path.suffix.lower() == ".txt":
                yield from _text_blocks(path, f, bar)
                continue
            for line_no, raw in enumerate(f, start=1):
                text = parse_record((str(path), line_no, raw), text_key)  # names file:line on a bad line
                if bar is not None:
                    bar.update(len(raw))
                if text is not None:
                    yield text


def _text_blocks(path: Path, f, bar: tqdm | None) -> Iterator[str]:
    block, size = [], 0
    for line_no, raw in enumerate(f, start=1):
        if bar is not None:
            bar.update(len(raw))
        try:
            block.append(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise PreprocessError(f"{path}:{line_no}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
        size += len(raw)
        if size >= TEXT_BLOCK_CHARS:
            yield "".join(block)
            block, size = [], 0
    if block:
        yield "".join(block)


def train_tokenizer(
    inputs: list[str | Path],
    kind: str,
    vocab_size: int,
    output: str | Path,
    *,
    text_key: str = "text",
    model_type: str = "bpe",
    num_threads: int = 1,
    progress: bool = True,
) -> tuple[Tokenizer, list[Path]]:
    """Train a `kind` tokenizer on `inputs` and write it under `output` (see `output_files`).

    Every check that can fail early (inputs, kind, vocab size, existing outputs) runs before training.
    Returns the tokenizer and the files written.
    """
    if kind not in KINDS:
        raise ValueError(f"tokenizer type {kind!r} is invalid: use one of {', '.join(KINDS)}")
    if vocab_size < 1:
        raise ValueError(f"vocab size {vocab_size} is invalid: it must be a positive integer")
    paths = check_inputs(inputs)
    files = output_files(kind, output)
    existing = [str(p) for p in files if p.exists()]
    if existing:
        raise FileExistsError(f"output {' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; "
                              "not overwriting it "
                              "(remove it or choose another --output)")
    bar = tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, desc=f"train {kind}",
               disable=not progress, file=sys.stderr)
    try:
        texts = iter_texts(paths, text_key, bar)
        if kind == "bpe":
            tokenizer = BPETokenizer.train(texts, vocab_size)
        else:
            from megazoo.data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

            tokenizer = SentencePieceTokenizer.train(texts, vocab_size, model_type=model_type,
                                                     num_threads=num_threads)
    finally:
        bar.close()
    files[0].parent.mkdir(parents=True, exist_ok=True)
    if kind == "bpe":
        write_new_file(files[0], tokenizer.to_json().encode("utf-8"))
    else:
        tokenizer.save(files[0])
    return tokenizer, files


# ---------------------------------------------------------------------------------------------------------
# Command line: recipes/cli.py calls `register`; `python -m megazoo.data.tokenizers.cli train ...` works too.

def register(subparsers) -> argparse.ArgumentParser:
    """Add the `tokenizer` command (with its `train` subcommand) to an argparse subparsers object."""
    parser = subparsers.add_parser("tokenizer", help="train a tokenizer on your corpus (bpe or sentencepiece)",
                                   description="Tokenizer tools.")
    sub = parser.add_subparsers(dest="tokenizer_command", required=True)
    train = sub.add_parser(
        "train", help="train a byte-level BPE or sentencepiece tokenizer on jsonl/txt files",
        description="Train a tokenizer on .jsonl (one {\"text\": ...} per line) and .txt files, streamed. "
                    f"Its end-of-document token is {EOD_TOKEN!r}. Existing outputs are never overwritten.")
    train.add_argument("--input", nargs="+", required=True, metavar="FILE", help=".jsonl/.json or .txt files")
    train.add_argument("--type", dest="kind", choices=KINDS, required=True,
                       help="bpe: byte-level BPE (GPT-2 style, `tokenizers`) written to OUTPUT.json; "
                            "sentencepiece: written to OUTPUT.model (+ OUTPUT.vocab)")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N", help="vocabulary size, eod included")
    train.add_argument("--output", required=True, metavar="PATH",
                       help="output path: PATH.json (bpe; PATH itself when it ends in .json) or PATH.model")
    train.add_argument("--text-key", default="text", help="jsonl field holding the document (default: text)")
    train.add_argument("--model-type", choices=("bpe", "unigram"), default=None,
                       help="sentencepiece algorithm (default: bpe); only with --type sentencepiece")
    train.add_argument("--threads", type=int, default=None, metavar="N",
                       help="sentencepiece trainer threads (default 1); the model depends on it, so keep it "
                            "fixed to reproduce a tokenizer; only with --type sentencepiece")
    train.set_defaults(func=run_train)
    return parser


def run_train(args: argparse.Namespace) -> int:
    """Run a parsed `tokenizer train` command: 0 on success, 2 with one `error:` line on bad input."""
    start = time.perf_counter()
    try:
        if args.kind != "sentencepiece":
            for flag, value in (("--model-type", args.model_type), ("--threads", args.threads)):
                if value is not None:
                    raise ValueError(f"{flag} applies to --type sentencepiece only, not --type {args.kind}")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads {args.threads} is invalid: it must be a positive integer")
        tokenizer, files = train_tokenizer(args.input, args.kind, args.vocab_size, args.output,
                                           text_key=args.text_key, model_type=args.model_type or "bpe",
                                           num_threads=args.threads or 1)
    except (OSError, ValueError) as error:  # FileNotFoundError, FileExistsError, PreprocessError, trainer errors
        print(f"megazoo tokenizer train: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {' and '.join(map(str, files))}: {args.kind} tokenizer, {tokenizer.vocab_size:,} tokens, "
          f"eod {EOD_TOKEN!r} = {tokenizer.eod_id}, in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megazoo")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tokenizer", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
