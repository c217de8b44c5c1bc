"""A user's corpus as records for `megazoo preprocess`: one document each, in the order given.

Inputs (the kind follows from the path):
- `.jsonl` (or `.json`, read as JSON lines like Megatron): one JSON object per line, the document in the
  `text_key` field. Blank lines are skipped. A line that is not a JSON object, lacks the key, or whose value is
  not a string stops the run with an error naming the file and the line number.
- `.txt`: the whole file is ONE document (Megatron's convention), read whole.
- `.parquet`: one document per row, the `text_key` column, streamed in record batches with pyarrow.
- a Hugging Face `datasets` folder (written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`): one
  document per row of the `text_key` column; a DatasetDict's `split` (default "train"). Read offline with
  `datasets.load_from_disk`; hub names are not fetched (download with `datasets` first, then save_to_disk).

A record is (path, number, raw bytes): the main process only reads; workers parse and encode (parse_record).
For jsonl the number is the line, for a .txt None (the whole file), and for parquet / datasets rows the row
number (1-based), the row handed over as a one-field JSON line so every kind is validated the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
HF_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (DatasetDict / Dataset)
ROW_BATCH = 1024

Record = tuple[str, "int | None", bytes]


class PreprocessError(ValueError):
    """Bad input (file, line, tokenizer, output): reported as one line, exit code 2."""


def input_kind(path: Path) -> str:
    """'jsonl' | 'text' | 'parquet' | 'datasets', or PreprocessError naming what is supported."""
    if path.is_dir():
        if any((path / marker).is_file() for marker in HF_MARKERS):
            return "datasets"
        raise PreprocessError(f"input {path} is a folder but not a Hugging Face dataset saved with save_to_disk "
                              f"(no {' or '.join(HF_MARKERS)})")
    suffix = path.suffix.lower()
    for kind, suffixes in (("jsonl", JSONL_SUFFIXES), ("text", TEXT_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if suffix in suffixes:
            return kind
    raise PreprocessError(f"input {path} has an unsupported suffix {path.suffix!r}: use "
                          f"{', '.join(JSONL_SUFFIXES + TEXT_SUFFIXES + PARQUET_SUFFIXES)} or a Hugging Face "
                          "datasets folder (save_to_disk)")


def _load_dataset(path: Path, split: str):
    import datasets  # slow import: only for datasets folders

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise PreprocessError(f"input {path} has no split {split!r}; splits: {', '.join(loaded)} (--split)")
        loaded = loaded[split]
    return loaded


def _columns(path: Path, kind: str, split: str) -> list[str]:
    if kind == "parquet":
        import pyarrow.parquet as pq
        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except Exception as error:  # pyarrow raises its own ArrowInvalid for a file that is not parquet
            raise PreprocessError(f"input {path} is not a readable parquet file: {error}") from None
    return list(_load_dataset(path, split).column_names)


def check_inputs(inputs: list[str | Path], text_key: str = "text", split: str = "train") -> list[Path]:
    """Every input exists, is of a supported kind, is not empty, and (parquet, datasets) has the text column:
    checked before any work starts."""
    if not inputs:
        raise PreprocessError("no input files given")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"input file not found: {path}")
        kind = input_kind(path)
        if kind != "datasets" and path.stat().st_size == 0:
            raise PreprocessError(f"input {path} is empty: it holds no documents")
        if kind in ("parquet", "datasets"):
            columns = _columns(path, kind, split)
            if text_key not in columns:
                raise PreprocessError(f"input {path} has no {text_key!r} column (columns: "
                                      f"{', '.join(map(repr, columns[:8])) or 'none'}); choose it with --text-key")
    return paths


def input_bytes(paths: list[Path]) -> int | None:
    """Bytes the progress bar counts (raw jsonl / txt bytes); None when a parquet or datasets input makes the
    total unknown in those units."""
    if any(input_kind(p) in ("parquet", "datasets") for p in paths):
        return None
    return sum(p.stat().st_size for p in paths)


def _rows(path: Path, kind: str, text_key: str, split: str) -> Iterator[object]:
    if kind == "parquet":
        import pyarrow.parquet as pq
        for batch in pq.ParquetFile(path).iter_batches(batch_size=ROW_BATCH, columns=[text_key]):
            yield from batch.column(0).to_pylist()
    else:
        for batch in _load_dataset(path, split).select_columns([text_key]).iter(batch_size=ROW_BATCH):
            yield from batch[text_key]


def iter_records(paths: list[Path], text_key: str = "text", split: str = "train") -> Iterator[Record]:
    """Records of every input in order: .jsonl one line at a time, rows in batches, a .txt whole."""
    for path in paths:
        kind = input_kind(path)
        if kind == "text":
            yield str(path), None, path.read_bytes()
        elif kind == "jsonl":
            with open(path, "rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    yield str(path), line_no, raw
        else:
            for row, value in enumerate(_rows(path, kind, text_key, split), start=1):
                yield f"{path} row", row, json.dumps({text_key: value}, ensure_ascii=False).encode("utf-8")


def parse_record(record: Record, text_key: str) -> str | None:
    """The document text of a record; None for a blank jsonl line; PreprocessError naming file:line."""
    path, line_no, raw = record
    where = path if line_no is None else f"{path}:{line_no}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise PreprocessError(f"{where}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    if line_no is None:
        return text
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as error:
        raise PreprocessError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(obj, dict):
        raise PreprocessError(f"{where}: expected a JSON object with a {text_key!r} field, got {type(obj).__name__}")
    if text_key not in obj:
        keys = ", ".join(map(repr, list(obj)[:5])) or "none"
        raise PreprocessError(f"{where}: no {text_key!r} field (keys: {keys}); choose the field with --text-key")
    if not isinstance(obj[text_key], str):
        raise PreprocessError(f"{where}: field {text_key!r} is {type(obj[text_key]).__name__}, not a string")
    return obj[text_key]
