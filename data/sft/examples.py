"""Instruction / chat examples for supervised fine-tuning: rows -> (token ids, loss mask), bad rows reported.

Inputs: `.jsonl` (one JSON object per line; blank lines skipped), `.parquet` (one row each) and Hugging Face
`datasets` folders written by save_to_disk (a DatasetDict's `split`). Each row is either

    {"prompt": "...", "response": "..."}                       one user turn and its reply, or
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   (the OpenAI / HF chat layout)

rendered through a chat template (data/sft/chat_template.py). A row that cannot become a training example (not JSON,
missing or mistyped fields, an unknown role, no assistant reply, more tokens than the sequence length) is a bad
row: every one is recorded with its place (file:line, or file row N) and the reason, and never silently dropped
or truncated. The caller decides whether bad rows fail the run (the default) or are skipped with the report.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megazoo.data.sft.chat_template import ChatTemplateError, Render, check_messages, encode_conversation
from megazoo.data.indexed.corpus_inputs import HF_MARKERS, JSONL_SUFFIXES, PARQUET_SUFFIXES, PreprocessError

ROW_LAYOUTS = "{\"prompt\": str, \"response\": str} or {\"messages\": [{\"role\", \"content\"}, ...]}"


@dataclass(frozen=True)
class BadRow:
    where: str  # "file.jsonl:12" or "file.parquet row 3"
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass
class SFTExamples:
    """What one pass over the inputs gave: the examples, and every bad row with its reason."""
    ids: list[list[int]] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)
    rows: int = 0  # rows read, blank jsonl lines not counted

    def report(self) -> str:
        """One line per bad row, after a count; "" when there are none."""
        if not self.bad:
            return ""
        lines = [f"{len(self.bad)} of {self.rows} rows are bad:"] + [f"  {bad}" for bad in self.bad]
        return "\n".join(lines)


def sft_input_kind(path: Path) -> str:
    """'jsonl' | 'parquet' | 'datasets', or PreprocessError naming what an SFT input may be."""
    if path.is_dir() and any((path / marker).is_file() for marker in HF_MARKERS):
        return "datasets"
    if path.is_file() and path.suffix.lower() in JSONL_SUFFIXES:
        return "jsonl"
    if path.is_file() and path.suffix.lower() in PARQUET_SUFFIXES:
        return "parquet"
    if not path.exists():
        raise FileNotFoundError(f"SFT input {path} does not exist")
    raise PreprocessError(f"SFT input {path} is not a .jsonl/.json file, a .parquet file or a Hugging Face datasets "
                          f"folder (save_to_disk); rows must be {ROW_LAYOUTS}")


def iter_rows(path: Path, split: str = "train") -> Iterator[tuple[str, object]]:
    """(where, row) for every row; for a jsonl line that is not JSON the row is a BadRow."""
    kind = sft_input_kind(path)
    if kind == "jsonl":
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                where = f"{path}:{line_no}"
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    yield where, BadRow(where, f"not valid UTF-8 ({error.reason} at byte {error.start})")
                    continue
                if not text.strip():
                    continue
                try:
                    yield where, json.loads(text.rstrip("\r\n"))  # columns count within the line
                except json.JSONDecodeError as error:
                    yield where, BadRow(where, f"not valid JSON ({error.msg} at column {error.colno})")
    elif kind == "parquet":
        import pyarrow.parquet as pq
        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield f"{path} row {row}", record
    else:
        import datasets  # slow import: only for datasets folders
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise PreprocessError(f"input {path} has no split {split!r}; splits: {', '.join(loaded)} (--split)")
            loaded = loaded[split]
        for row, record in enumerate(loaded, start=1):
            yield f"{path} row {row}", record


def row_messages(row: object) -> list[dict]:
    """The row as checked chat messages, or ChatTemplateError naming the field and the valid layouts."""
    if not isinstance(row, dict):
        raise ChatTemplateError(f"a row is {type(row).__name__}, expected an object: {ROW_LAYOUTS}")
    if "messages" in row and row["messages"] is not None:
        return check_messages(row["messages"])
    if "prompt" not in row and "response" not in row:
        raise ChatTemplateError(f"has neither 'messages' nor 'prompt' + 'response' (fields: "
                                f"{', '.join(map(str, row)) or 'none'}); valid: {ROW_LAYOUTS}")
    for key in ("prompt", "response"):
        if key not in row or row[key] is None:
            raise ChatTemplateError(f"missing field '{key}'; valid: {ROW_LAYOUTS}")
        if not isinstance(row[key], str):
            raise ChatTemplateError(f"'{key}' is {type(row[key]).__name__}, expected a string")
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


def read_examples(inputs: list[str | Path], render: Render, encode, seq_len: int, *,
                  split: str = "train") -> SFTExamples:
    """Every row of `inputs` tokenized through `render` + `encode` (data/sft/chat_template.py), or a BadRow.

    An example may hold at most `seq_len` tokens: one sequence of the model's input (its last token is only
    ever a target's context, so `seq_len` tokens train on `seq_len - 1` predictions at most)."""
    if seq_len < 2:
        raise PreprocessError(f"seq_len {seq_len} is invalid: an example needs at least 2 tokens")
    paths = [Path(p) for p in inputs]
    for path in paths:
        sft_input_kind(path)  # every input checked before the first is read
    out = SFTExamples()
    for path in paths:
        for where, row in iter_rows(path, split):
            out.rows += 1
            if isinstance(row, BadRow):
                out.bad.append(row)
                continue
            try:
                ids, mask = encode_conversation(row_messages(row), render, encode)
            except ChatTemplateError as error:
                out.bad.append(BadRow(where, str(error)))
                continue
            if len(ids) > seq_len:
                out.bad.append(BadRow(where, f"{len(ids)} tokens, longer than the sequence length {seq_len} "
                                             "(never truncated: shorten the row or raise --seq-len)"))
                continue
            if not any(mask[1:]):  # the first token is never a target
                out.bad.append(BadRow(where, "no response token can be trained (empty reply)"))
                continue
            out.ids.append(ids)
            out.masks.append(mask)
    return out
