"""An instruction dataset every machine has: the standard library's documented functions.

Each public, documented function or method of the stdlib sources (data/stdlib_corpus.py) becomes one row:
prompt = its docstring (the question: "what function is described here?"), response = its signature as written
(`def name(args) -> annotation:`), read with `ast` so nothing is imported or run. The rows are written as
jsonl for `megazoo preprocess --format sft`, and their lengths are a real distribution (short one-line docstrings
next to page-long ones) for measuring packing (benchmarks/sft_packing.py).

    python -m megazoo.data.sft.stdlib_sft OUTPUT.jsonl [--max-bytes N] [--max-doc-chars N]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from megazoo.data.stdlib_corpus import split_train_val, stdlib_documents


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"


def function_rows(source: str, max_doc_chars: int = 1500) -> Iterator[dict]:
    """{"prompt": docstring, "response": signature} for each public documented function in `source`."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if doc and len(doc) <= max_doc_chars:
            yield {"prompt": doc, "response": _signature(node)}


def stdlib_sft_rows(max_bytes: int | None = 4_000_000, max_doc_chars: int = 1500,
                    val_fraction: float = 0.0) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows); a file's rows go to one side only (data/stdlib_corpus.py's stable split)."""
    docs = stdlib_documents(max_bytes)
    train_texts, val_texts = split_train_val(docs, val_fraction) if val_fraction else ([t for _, t in docs], [])
    rows = [[row for text in texts for row in function_rows(text, max_doc_chars)] for texts in (train_texts, val_texts)]
    return rows[0], rows[1]


def write_rows(rows: list[dict], path: str | Path) -> None:
    """The rows as jsonl, one object a line (the input `megazoo preprocess --format sft` reads)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megazoo.data.sft.stdlib_sft", description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the jsonl file to write")
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="stdlib source bytes to read")
    parser.add_argument("--max-doc-chars", type=int, default=1500, help="skip longer docstrings")
    args = parser.parse_args(argv)
    rows, _ = stdlib_sft_rows(args.max_bytes, args.max_doc_chars)
    write_rows(rows, args.output)
    print(f"wrote {len(rows):,} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
