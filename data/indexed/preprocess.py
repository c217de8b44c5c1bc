"""Tokenize raw text into an indexed dataset (PREFIX.bin/.idx), streaming, on several processes.

    megazoo preprocess --input a.jsonl b.txt c.parquet hf_saved/ --tokenizer tok.json --output-prefix data/corpus

Inputs, one document per record (data/indexed/corpus_inputs.py): `.jsonl` lines (the `--text-key` field), whole `.txt`
files (Megatron's convention), `.parquet` rows and Hugging Face `datasets` folders written by save_to_disk
(the `--text-key` column; a DatasetDict's `--split`). Errors name the file and the line or row.

Every document is followed by the tokenizer's end-of-document id (`append_eod=True`), so documents never run
into each other once samples cross their boundaries. Memory does not grow with the corpus: the main process
reads raw records one at a time, a pool of `workers` processes parses and encodes them in chunks (a bounded
number in flight), and each chunk is written as soon as its turn comes, so the output order (and every
output byte) is the same for any number of workers. Parallelism is across documents: one big .txt document
is encoded by one worker. The output folder is created when missing (and removed again if the run fails and
left it empty); nothing appears under the output prefix unless the whole run succeeds; the files get the
permissions a plain open() gives (0666 less the umask), like any file the user writes.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megazoo.data.fileio import stale_temp_files
from megazoo.data.indexed.corpus_inputs import (JSONL_SUFFIXES, TEXT_SUFFIXES, PreprocessError,  # noqa: F401 (re-exported)
                                        Record, check_inputs, input_bytes, iter_records, parse_record)
from megazoo.data.indexed.dataset import IndexedDatasetWriter, data_paths
from megazoo.data.sft.preprocess import add_arguments as add_sft_arguments, run_sft_cli
from megazoo.data.tokenizers.tokenizer import Tokenizer
from megazoo.data.tokenizers.loading import load_tokenizer

CHUNK_DOCS = 256  # a chunk ends at this many records (lines / .txt files) or CHUNK_BYTES, whichever is first
CHUNK_BYTES = 1 << 17  # big enough to amortise inter-process pickling, small enough to balance the workers


@dataclass(frozen=True)
class PreprocessStats:
    documents: int
    tokens: int
    input_bytes: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def _chunks(records: Iterator[Record]) -> Iterator[tuple[list[Record], int]]:
    """Group records into (records, input bytes) chunks of at most CHUNK_DOCS records or ~CHUNK_BYTES."""
    chunk, nbytes = [], 0
    for record in records:
        chunk.append(record)
        nbytes += len(record[2])
        if len(chunk) >= CHUNK_DOCS or nbytes >= CHUNK_BYTES:
            yield chunk, nbytes
            chunk, nbytes = [], 0
    if chunk:
        yield chunk, nbytes


# Per-process encoder state: set in the parent for workers=1, in each pool process by the initializer.
_STATE: tuple[Tokenizer, int | None, str] | None = None


def _init_worker(state: tuple[Tokenizer, int | None, str] | None) -> None:
    global _STATE
    _STATE = state


def _init_pool_worker(state: tuple[Tokenizer, int | None, str]) -> None:
    """A pool process: Ctrl-C reaches the whole process group, but only the parent answers it (no traceback
    per worker); the parent's SIGTERM handler is not inherited, so pool.terminate() ends a worker quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _init_worker(state)


class _Terminated(BaseException):
    """SIGTERM during a preprocess, raised in the main thread so the writer removes its temporary files on the
    way out (a BaseException: no `except Exception` on the way may swallow it)."""


def _raise_terminated(signum, frame):
    raise _Terminated


def _encode_chunk(records: list[Record]) -> tuple[np.ndarray, np.ndarray]:
    """(concatenated ids, per-document lengths). numpy arrays pickle far faster than lists of lists.
    Plain `encode` per document (not encode_batch): parallelism comes from the process pool, and Rust
    threads inside forked workers would oversubscribe the cores (and make tokenizers warn)."""
    tokenizer, eod, text_key = _STATE
    encoded = []
    for record in records:
        text = parse_record(record, text_key)
        if text is None:
            continue
        ids = tokenizer.encode(text)
        if eod is not None:
            ids.append(eod)
        encoded.append(ids)
    lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter((i for ids in encoded for i in ids), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def preprocess(
    inputs: list[str | Path],
    tokenizer: Tokenizer,
    output_prefix: str | Path,
    *,
    workers: int = 1,
    text_key: str = "text",
    append_eod: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    split: str = "train",
) -> PreprocessStats:
    """Tokenize `inputs` (see the module docstring for formats) into `output_prefix`.bin/.idx.

    Output is byte-identical for any `workers`. Raises FileNotFoundError / FileExistsError / PreprocessError
    with the path (and line) named; on any error the output prefix is left untouched.
    """
    if workers < 1:
        raise PreprocessError(f"workers must be >= 1, got {workers}")
    paths = check_inputs(inputs, text_key, split)
    eod = tokenizer.eod_id if append_eod else None
    start = time.perf_counter()
    bar = tqdm(total=input_bytes(paths), unit="B", unit_scale=True, desc="preprocess", disable=not progress,
               file=sys.stderr)
    out_dir = Path(str(output_prefix)).parent
    created = [d for d in (out_dir, *out_dir.parents) if not d.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)  # like `megazoo tokenizer train`: data/ need not exist yet
    pool, total_bytes = None, 0
    try:
        with IndexedDatasetWriter(output_prefix, tokenizer.vocab_size, overwrite=overwrite) as writer:
            def write(result: tuple[np.ndarray, np.ndarray], nbytes: int) -> None:
                nonlocal total_bytes
                writer.add_documents(*result)
                total_bytes += nbytes
                bar.update(nbytes)
                bar.set_postfix(docs=writer.num_documents, tokens=writer.num_tokens, refresh=False)

            chunks = _chunks(iter_records(paths, text_key, split))
            state = (tokenizer, eod, text_key)
            if workers == 1:
                _init_worker(state)
                for records, nbytes in chunks:
                    write(_encode_chunk(records), nbytes)
            else:
                pool = multiprocessing.Pool(workers, initializer=_init_pool_worker, initargs=(state,))
                # At most 2 chunks per worker in flight: workers stay busy while memory stays bounded
                # (Pool.imap would read the whole input ahead). Results are taken in submission order.
                pending: collections.deque = collections.deque()
                for records, nbytes in chunks:
                    pending.append((pool.apply_async(_encode_chunk, (records,)), nbytes))
                    if len(pending) >= 2 * workers:
                        result, done_bytes = pending.popleft()
                        write(result.get(), done_bytes)
                while pending:
                    result, done_bytes = pending.popleft()
                    write(result.get(), done_bytes)
            documents, tokens = writer.num_documents, writer.num_tokens
            if documents == 0:  # raised inside the block: the writer drops its files
                raise PreprocessError(f"no documents in {', '.join(map(str, paths))} (only blank lines?): nothing "
                                      "written")
    except BaseException:
        for folder in created:  # the folders this run created, innermost first, if still empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    finally:
        if pool is not None:
            pool.terminate()  # on error: stop encoding at once; on success: the pool is idle anyway
            pool.join()
        bar.close()
        _init_worker(None)
    return PreprocessStats(documents, tokens, total_bytes, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------------------
# Command line: `megazoo preprocess ...` (recipes/cli.py calls register), or `python -m megazoo.data.indexed.preprocess ...`.

def register(subparsers) -> argparse.ArgumentParser:
    """Add the `preprocess` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "preprocess", help="tokenize jsonl/txt/parquet/datasets inputs into an indexed dataset (PREFIX.bin + .idx)",
        description="Tokenize jsonl (one {\"text\": ...} per line), txt (whole file = one document), parquet "
                    "(one row each) and Hugging Face datasets folders (save_to_disk; one row each) into "
                    "PREFIX.bin + PREFIX.idx, an end-of-document token after every document.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help=".jsonl/.json, .txt or .parquet files, or Hugging Face datasets folders")
    parser.add_argument("--tokenizer", required=True, metavar="PATH",
                        help="GPT-2 BPE directory (vocab.json + merges.txt or encoder.json + vocab.bpe), a "
                             "tokenizers .json file, a sentencepiece .model or hf:NAME")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="output path without extension; writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="encoding processes (default: the CPU count)")
    parser.add_argument("--text-key", default="text",
                        help="jsonl field / parquet or datasets column holding the document (default: text)")
    parser.add_argument("--split", default="train", help="the split of a datasets DatasetDict (default: train)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.bin/.idx")
    add_sft_arguments(parser)  # --format sft (data/sft/preprocess.py): chat rows -> tokens + loss mask
    parser.set_defaults(func=run_cli)
    return parser


def run_cli(args: argparse.Namespace) -> int:
    """Run a parsed `preprocess` command: 0 on success, 2 with one `error:` line on bad input; stopped by Ctrl-C
    or SIGTERM, one line and 130 / 143, with no temporary file left (one that a SIGKILLed run left is removed
    by the next run, which says so)."""
    for stale in [t for p in data_paths(args.output_prefix) for t in stale_temp_files(p)]:
        stale.unlink(missing_ok=True)
        print(f"megazoo preprocess: removed {stale}, left by an interrupted run", file=sys.stderr)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        return _run_cli(args)
    except KeyboardInterrupt:
        print("megazoo preprocess: stopped by Ctrl-C; no output and no temporary file were left", file=sys.stderr)
        return 128 + signal.SIGINT
    except _Terminated:
        print("megazoo preprocess: stopped by SIGTERM; no output and no temporary file were left", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run_cli(args: argparse.Namespace) -> int:
    if getattr(args, "format", "text") == "sft":
        return run_sft_cli(args)
    if getattr(args, "seq_len", None) is not None:
        print("megazoo preprocess: error: --seq-len applies to --format sft only (text documents are cut into "
              "samples at training time)", file=sys.stderr)
        return 2
    try:
        if args.workers < 1:
            raise PreprocessError(f"--workers {args.workers} is invalid: it must be a positive integer")
        paths = check_inputs(args.input, args.text_key, args.split)
        existing = [str(p) for p in data_paths(args.output_prefix) if p.exists()]
        if existing and not args.overwrite:  # checked before loading the tokenizer: fail fast
            raise FileExistsError(f"output {' and '.join(existing)} already exists; pass --overwrite to replace it")
        tokenizer = load_tokenizer(args.tokenizer)
        stats = preprocess(paths, tokenizer, args.output_prefix, workers=args.workers, text_key=args.text_key,
                           overwrite=args.overwrite, split=args.split)
    except (OSError, ValueError) as error:  # includes FileNotFoundError, FileExistsError, PreprocessError
        print(f"megazoo preprocess: error: {error}", file=sys.stderr)
        return 2
    bin_path, idx_path = data_paths(args.output_prefix)
    print(f"wrote {bin_path} and {idx_path}: {stats.documents:,} documents, {stats.tokens:,} tokens in "
          f"{stats.seconds:.1f} s ({stats.tokens_per_second:,.0f} tokens/s, {args.workers} workers)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megazoo")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["preprocess", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
