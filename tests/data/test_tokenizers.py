"""Every kind of tokenizer behind the one protocol: GPT-2 BPE directory, tokenizers json, sentencepiece model,
`hf:` (a locally saved Hugging Face tokenizer; the hub only offline), and `megazoo tokenizer train`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megazoo.data.indexed.dataset import IndexedDataset
from megazoo.data.indexed.preprocess import load_tokenizer as preprocess_load_tokenizer
from megazoo.data.indexed.preprocess import main as preprocess_main
from megazoo.data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer
from megazoo.data.tokenizers.tokenizer import EOD_TOKEN, BPETokenizer, HFTokenizer, Tokenizer
from megazoo.data.tokenizers.loading import load_tokenizer
from megazoo.data.tokenizers.cli import main as tokenizer_main
from megazoo.data.tokenizers.cli import register

REPO = Path(__file__).resolve().parents[2]
VOCAB = 1000
TRAIN_LINES = slice(0, 1600)  # wiki.valid.tokens lines the trained tokenizers learn from ...
HELD_OUT_LINES = slice(2000, 2600)  # ... and lines they never saw, for the round trips
TRICKY = [
    "",
    "Hello world",
    "  leading, repeated   and trailing spaces  \n\n\ttabs\r\n",
    "Unicode: naïve café — 東京 🚀 \x00\x7f",
    "A literal <|endoftext|> inside text is text, not a boundary.",
    "sentencepiece's space mark \u2581 as text: x\u2581y \u2581\u2581",
]


@pytest.fixture(scope="module")
def wiki_lines(data_dir) -> list[str]:
    return (data_dir / "wikitext103" / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines(keepends=True)


@pytest.fixture(scope="module")
def held_out(wiki_lines) -> str:
    return "".join(wiki_lines[HELD_OUT_LINES])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, wiki_lines) -> list[Path]:
    """The training slice as one .txt file (first half) and one .jsonl file (one line per document)."""
    root = tmp_path_factory.mktemp("corpus")
    lines = wiki_lines[TRAIN_LINES]
    half = len(lines) // 2
    txt, jsonl = root / "part1.txt", root / "part2.jsonl"
    txt.write_text("".join(lines[:half]), encoding="utf-8")
    jsonl.write_text("".join(json.dumps({"text": line, "id": i}) + "\n" for i, line in enumerate(lines[half:])),
                     encoding="utf-8")
    return [txt, jsonl]


def train_cli(corpus: list[Path], kind: str, output: Path, *extra: str) -> int:
    return tokenizer_main(["train", "--input", *map(str, corpus), "--type", kind, "--vocab-size", str(VOCAB),
                           "--output", str(output), *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> dict[str, Path]:
    """Tokenizer files written by `megazoo tokenizer train`, per kind."""
    root = tmp_path_factory.mktemp("trained")
    assert train_cli(corpus, "bpe", root / "bpe") == 0
    assert train_cli(corpus, "sentencepiece", root / "sp") == 0
    return {"bpe": root / "bpe.json", "sentencepiece": root / "sp.model"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, data_dir) -> Path:
    """A Hugging Face tokenizer directory saved from the shared GPT-2 files (no hub involved)."""
    from transformers import GPT2TokenizerFast

    bpe = data_dir / "gpt2_bpe"
    vocab = json.loads((bpe / "vocab.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in (bpe / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
              if line]
    # vocab=/merges= objects, never vocab_file=/merges_file=: the latter builds an EMPTY tokenizer (README).
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    GPT2TokenizerFast(vocab=vocab, merges=merges).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def specs(data_dir, trained, hf_dir) -> dict[str, str]:
    return {"gpt2-dir": str(data_dir / "gpt2_bpe"), "tokenizers-json": str(trained["bpe"]),
            "sentencepiece": str(trained["sentencepiece"]), "hf-local-dir": f"hf:{hf_dir}"}


# ---------------------------------------------------------------------------------------------------------
# The protocol on every kind


@pytest.mark.parametrize("kind", ["gpt2-dir", "tokenizers-json", "sentencepiece", "hf-local-dir"])
def test_protocol_on_every_kind(kind, specs, held_out):
    tokenizer = load_tokenizer(specs[kind])
    assert isinstance(tokenizer, Tokenizer)
    assert 0 <= tokenizer.eod_id < tokenizer.vocab_size
    ids = tokenizer.encode(held_out[:5000])
    assert ids and all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.eod_id not in ids  # encode never adds eod: the data pipeline does
    assert tokenizer.decode([tokenizer.eod_id]) == EOD_TOKEN
    a, b = "first document.", "second one"
    assert tokenizer.decode(tokenizer.encode(a) + [tokenizer.eod_id] + tokenizer.encode(b)) == a + EOD_TOKEN + b
    # A literal "<|endoftext|>" in a document is text, never a document boundary.
    assert tokenizer.eod_id not in tokenizer.encode(f"x {EOD_TOKEN} y")
    for text in TRICKY:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_gpt2_dir_known_ids(specs):
    tokenizer = load_tokenizer(specs["gpt2-dir"])
    assert isinstance(tokenizer, GPT2BPETokenizer)
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert (tokenizer.eod_id, tokenizer.vocab_size) == (50256, 50257)


def test_hf_local_dir_matches_gpt2_dir(specs, held_out):
    gpt2 = load_tokenizer(specs["gpt2-dir"])
    hf = load_tokenizer(specs["hf-local-dir"])
    assert isinstance(hf, HFTokenizer)
    assert hf.encode("Hello world") == [15496, 995]
    assert (hf.eod_id, hf.vocab_size) == (50256, 50257)
    for text in [held_out, *TRICKY]:
        assert hf.encode(text) == gpt2.encode(text)
    assert hf.decode(gpt2.encode(held_out)) == held_out


def test_preprocess_load_tokenizer_is_the_same_function():
    assert preprocess_load_tokenizer is load_tokenizer  # existing callers of data.preprocess keep working


# ---------------------------------------------------------------------------------------------------------
# Trained tokenizers: round trips on real text, determinism, use in preprocess


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_trained_round_trip_on_held_out_wikitext(kind, trained, held_out):
    tokenizer = load_tokenizer(trained[kind])
    assert isinstance(tokenizer, BPETokenizer if kind == "bpe" else SentencePieceTokenizer)
    assert tokenizer.vocab_size == VOCAB
    ids = tokenizer.encode(held_out)
    assert tokenizer.decode(ids) == held_out
    # It learnt the corpus: far fewer tokens than UTF-8 bytes (byte fallback alone would give one per byte).
    assert len(ids) < 0.6 * len(held_out.encode("utf-8"))


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_training_is_deterministic(kind, tmp_path, corpus, trained, held_out):
    assert train_cli(corpus, kind, tmp_path / "again") == 0
    again = tmp_path / ("again.json" if kind == "bpe" else "again.model")
    assert again.read_bytes() == trained[kind].read_bytes()
    assert load_tokenizer(again).encode(held_out) == load_tokenizer(trained[kind]).encode(held_out)


def test_sentencepiece_unigram_and_in_memory_training(wiki_lines, held_out):
    texts = wiki_lines[:800]  # unigram training is the slowest: a smaller corpus and vocabulary
    first = SentencePieceTokenizer.train(iter(texts), 600, model_type="unigram")  # an iterator: streamed
    second = SentencePieceTokenizer.train(texts, 600, model_type="unigram")
    assert first.vocab_size == 600
    assert first.encode(held_out) == second.encode(held_out)
    assert first.decode(first.encode(held_out)) == held_out
    for text in TRICKY:
        assert first.decode(first.encode(text)) == text


def test_preprocess_with_a_sentencepiece_model(tmp_path, trained, held_out):
    docs = [d for d in held_out.split(" = ") if d.strip()][:40]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    spec = str(trained["sentencepiece"])
    assert preprocess_main(["--input", str(src), "--tokenizer", spec, "--output-prefix", str(tmp_path / "out"),
                            "--workers", "2"]) == 0
    tokenizer = load_tokenizer(spec)
    dataset = IndexedDataset(tmp_path / "out")
    assert len(dataset) == len(docs)
    for i, doc in enumerate(docs):
        assert dataset.doc(i).tolist() == tokenizer.encode(doc) + [tokenizer.eod_id]


# ---------------------------------------------------------------------------------------------------------
# hf: offline, and bad inputs


def test_hf_name_offline_says_the_hub_is_unreachable(tmp_path):
    """HF_HUB_OFFLINE=1 and an empty cache: nothing touches the network, and the error says what to do."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=str(REPO))
    code = ("from megazoo.data.tokenizers.loading import load_tokenizer\n"
            "try:\n    load_tokenizer('hf:gpt2')\n"
            "except ConnectionError as error:\n    print(error)\nelse:\n    print('loaded?!')\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    message = result.stdout
    assert "'gpt2'" in message and "hub could not be reached" in message
    assert "local directory" in message and "hf:/path/to/dir" in message


def test_bad_tokenizer_specs(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="write hf:gpt2"):  # a bare name: hint at hf:
        load_tokenizer("gpt2")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.txt.*unsupported suffix"):
        load_tokenizer(tmp_path / "notes.txt")
    (tmp_path / "broken.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"broken\.model is not a valid sentencepiece model"):
        load_tokenizer(tmp_path / "broken.model")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json"):
        load_tokenizer(tmp_path / "broken.json")
    with pytest.raises(FileNotFoundError, match="vocab.json"):  # a directory without GPT-2 files lists them
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(f"hf:{tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match="names no tokenizer"):
        load_tokenizer("hf:")
    with pytest.raises(ValueError, match=str(hf_dir.parent)):  # a directory AutoTokenizer cannot read
        load_tokenizer(f"hf:{hf_dir.parent}")


def test_cli_bad_inputs(tmp_path, corpus, trained, capsys):
    assert train_cli([tmp_path / "missing.txt"], "bpe", tmp_path / "out") == 2
    assert "missing.txt" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n", encoding="utf-8")
    for kind in ("bpe", "sentencepiece"):
        assert train_cli([bad], kind, tmp_path / "out") == 2
        assert f"{bad}:2: no 'text' field" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))  # nothing written by a failed run
    assert train_cli(corpus, "bpe", tmp_path / "out", "--model-type", "unigram") == 2
    assert "--model-type applies to --type sentencepiece" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_cli_refuses_to_overwrite(kind, corpus, trained, capsys):
    before = trained[kind].read_bytes()
    assert train_cli(corpus, kind, trained[kind]) == 2  # the output as written (with .json / .model)
    err = capsys.readouterr().err
    assert str(trained[kind]) in err and "already exist" in err
    assert trained[kind].read_bytes() == before


def test_register_adds_the_tokenizer_command(tmp_path, corpus, capsys):
    """What recipes/cli.py does with `register`: `megazoo tokenizer train ...` parses and runs."""
    parser = argparse.ArgumentParser(prog="megazoo")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tokenizer", "train", "--input", str(corpus[0]), "--type", "bpe", "--vocab-size",
                              "400", "--output", str(tmp_path / "tok")])
    assert args.func(args) == 0
    assert f"wrote {tmp_path / 'tok.json'}" in capsys.readouterr().out
    assert load_tokenizer(tmp_path / "tok.json").vocab_size == 400
    with pytest.raises(SystemExit) as exit_info:  # argparse rejects an unknown --type with exit code 2
        parser.parse_args(["tokenizer", "train", "--input", "x.txt", "--type", "wordpiece", "--vocab-size", "9",
                           "--output", "o"])
    assert exit_info.value.code == 2
