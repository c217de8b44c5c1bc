"""`preprocess` and `megazoo preprocess`: jsonl/txt -> .bin/.idx with the GPT-2 BPE, round trips and bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import megazoo.data.indexed.preprocess as prep
from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megazoo.data.indexed.dataset import IndexedDataset, data_paths
from megazoo.data.indexed.preprocess import PreprocessError, main, preprocess
from megazoo.data.tokenizers.tokenizer import BPETokenizer

REPO = Path(__file__).resolve().parents[2]
EOD = 50256
SYNTHETIC = [
    "Hello world",
    "",  # an empty document is still a document: just its eod
    "Two\nlines, trailing spaces   \n\n",
    "Unicode: naïve café — 東京 🚀",
    "A literal <|endoftext|> inside text is text, not a boundary.",
]


@pytest.fixture(scope="module")
def gpt2(data_dir) -> GPT2BPETokenizer:
    return GPT2BPETokenizer.from_dir(data_dir / "gpt2_bpe")


@pytest.fixture(scope="module")
def wiki_articles(data_dir) -> list[str]:
    """The first ~400 KB of wiki.valid.tokens split into articles (a title line is ' = Title = ')."""
    lines = (data_dir / "wikitext103" / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines(keepends=True)
    articles: list[list[str]] = []
    for line in lines[:1300]:
        if re.fullmatch(r" = [^=].* = \n", line) or not articles:
            articles.append([])
        articles[-1].append(line)
    return ["".join(a) for a in articles]


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def decoded_documents(prefix, tokenizer) -> list[str]:
    ds = IndexedDataset(prefix)
    docs = []
    for i in range(len(ds)):
        ids = ds.doc(i)
        assert ids[-1] == tokenizer.eod_id  # every document ends with eod ...
        docs.append(tokenizer.decode(ids[:-1].tolist()))  # ... and decodes back to its text exactly
    return docs


def test_round_trip_jsonl_txt_and_real_wikitext(tmp_path, gpt2, wiki_articles):
    synthetic = write_jsonl(tmp_path / "synthetic.jsonl", SYNTHETIC)
    txt = tmp_path / "story.txt"
    txt.write_text("A whole file is one document.\n\nEven across blank lines.\n", encoding="utf-8")
    wiki = write_jsonl(tmp_path / "wiki.jsonl", wiki_articles)
    stats = preprocess([synthetic, txt, wiki], gpt2, tmp_path / "out", workers=2, progress=False)
    expected = SYNTHETIC + [txt.read_text(encoding="utf-8")] + wiki_articles
    assert decoded_documents(tmp_path / "out", gpt2) == expected
    ds = IndexedDataset(tmp_path / "out")
    assert ds.dtype == np.uint16  # GPT-2's 50,257 ids fit
    assert stats.documents == len(expected) and stats.tokens == ds.num_tokens > 70_000
    assert ds.doc(0).tolist() == [15496, 995, EOD]
    ds.verify_data()


def test_worker_count_and_chunking_do_not_change_the_output(tmp_path, gpt2, wiki_articles, monkeypatch):
    lines = [line for article in wiki_articles for line in article.splitlines(keepends=True)]
    source = write_jsonl(tmp_path / "lines.jsonl", lines)
    preprocess([source], gpt2, tmp_path / "one", workers=1, progress=False)
    preprocess([source], gpt2, tmp_path / "two", workers=2, progress=False)
    monkeypatch.setattr(prep, "CHUNK_DOCS", 7)  # many small chunks in flight, finishing out of order
    preprocess([source], gpt2, tmp_path / "small", workers=2, progress=False)
    for other in ("two", "small"):
        for reference, path in zip(data_paths(tmp_path / "one"), data_paths(tmp_path / other)):
            assert reference.read_bytes() == path.read_bytes(), path
    assert len(IndexedDataset(tmp_path / "one")) == len(lines)


def test_no_eod_and_blank_lines_and_text_key(tmp_path, gpt2):
    source = tmp_path / "body.jsonl"
    source.write_text('{"body": "Hello world"}\n\n   \n{"body": "Hello"}\n', encoding="utf-8")
    preprocess([source], gpt2, tmp_path / "out", text_key="body", append_eod=False, progress=False)
    ds = IndexedDataset(tmp_path / "out")
    assert [ds.doc(i).tolist() for i in range(len(ds))] == [[15496, 995], [15496]]


def test_tokenizer_json_file_works(tmp_path):
    tokenizer = BPETokenizer.train(["some words to learn from", "more words"] * 20, vocab_size=300)
    tokenizer.save(tmp_path / "tok.json")
    source = write_jsonl(tmp_path / "in.jsonl", ["some words", "more"])
    assert main(["--input", str(source), "--tokenizer", str(tmp_path / "tok.json"),
                 "--output-prefix", str(tmp_path / "out"), "--workers", "1"]) == 0
    assert decoded_documents(tmp_path / "out", tokenizer) == ["some words", "more"]


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": "fine"}\n{"content": "no text key"}\n', r"bad\.jsonl:3: no 'text' field"),
    ('{"text": "ok"}\nnot json\n', r"bad\.jsonl:2: not valid JSON"),
    ('["a list"]\n', r"bad\.jsonl:1: expected a JSON object"),
    ('{"text": 5}\n', r"bad\.jsonl:1: field 'text' is int"),
])
def test_bad_jsonl_lines_are_named_and_nothing_is_written(tmp_path, gpt2, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content, encoding="utf-8")
    with pytest.raises(PreprocessError, match=message):
        preprocess([bad], gpt2, tmp_path / "out", workers=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no output, no temporary files


def test_bad_utf8_is_named(tmp_path, gpt2):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(PreprocessError, match="latin1.txt: not valid UTF-8"):
        preprocess([bad], gpt2, tmp_path / "out", progress=False)


def test_cli_errors_exit_2_and_never_overwrite(tmp_path, gpt2, data_dir, capsys):
    tokenizer = str(data_dir / "gpt2_bpe")
    source = write_jsonl(tmp_path / "in.jsonl", SYNTHETIC)
    out = str(tmp_path / "out")

    def run(*args: str) -> tuple[int, str]:
        code = main(["--tokenizer", tokenizer, "--output-prefix", out, "--workers", "1", *args])
        return code, capsys.readouterr().err

    code, err = run("--input", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "input file not found" in err and "missing.jsonl" in err
    code, err = run("--input", str(source), "--workers", "0")
    assert code == 2 and "--workers 0" in err
    (tmp_path / "notes.csv").write_text("a,b\n")
    code, err = run("--input", str(tmp_path / "notes.csv"))
    assert code == 2 and "unsupported suffix '.csv'" in err
    code, err = main(["--input", str(source), "--tokenizer", str(tmp_path / "nope"), "--output-prefix", out]), \
        capsys.readouterr().err
    assert code == 2 and "tokenizer" in err and "nope" in err
    assert not any(p.exists() for p in data_paths(out))

    assert run("--input", str(source))[0] == 0
    before = [p.read_bytes() for p in data_paths(out)]
    other = write_jsonl(tmp_path / "other.jsonl", ["different"])
    code, err = run("--input", str(other))
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert [p.read_bytes() for p in data_paths(out)] == before  # nothing overwritten
    # A failing run with --overwrite still leaves the old output intact.
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    code, err = run("--input", str(tmp_path / "bad.jsonl"), "--overwrite")
    assert code == 2 and "bad.jsonl:2" in err
    assert [p.read_bytes() for p in data_paths(out)] == before
    assert run("--input", str(other), "--overwrite")[0] == 0
    assert decoded_documents(out, gpt2) == ["different"]


def test_module_entry_point(tmp_path, data_dir):
    source = write_jsonl(tmp_path / "in.jsonl", SYNTHETIC)
    command = [sys.executable, "-m", "megazoo.data.indexed.preprocess", "--input", str(source), "--tokenizer",
               str(data_dir / "gpt2_bpe"), "--output-prefix", str(tmp_path / "out"), "--workers", "2"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "5 documents" in done.stdout and "tokens/s" in done.stdout
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "megazoo preprocess: error:" in again.stderr and "already exists" in again.stderr
