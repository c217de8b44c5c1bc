"""Issue #11 reliability of data: .bin corruption and bad token ids are caught (hashing cached), pre-start checks
of datasets and tokenizers, preprocess refuses empty input and merges, outputs get the umask, and eval checks
its data before torchrun and records which checkpoint it evaluated."""

from __future__ import annotations

import json
import os
import shutil
import stat
import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import megazoo.data.indexed.dataset as indexed
import megazoo.workers.supervisor as launcher
from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megazoo.data.indexed.dataset import IndexedDatasetWriter, data_paths
from megazoo.data.indexed.formats import check_indexed
from megazoo.data.indexed.preprocess import main as preprocess_main
from megazoo.data.tokenizers.loading import check_tokenizer_spec
from cli_helpers import megazoo

PAST = 1_000_000_000  # a fixed mtime long ago (2001): the file has settled, so its verification is cached


def _write(prefix, docs, vocab=1000):
    with IndexedDatasetWriter(prefix, vocab_size=vocab) as writer:
        for doc in docs:
            writer.add_document(doc)
    return prefix


@pytest.fixture
def corpus(tmp_path):
    return _write(tmp_path / "corpus", [[1, 2, 3], [], [4, 5, 700, 6], [7] * 10])


def test_bin_corruption_is_caught_and_the_verification_is_cached(corpus, monkeypatch):
    bin_path, _ = data_paths(corpus)
    os.utime(bin_path, ns=(PAST, PAST))
    assert check_indexed(corpus).num_tokens == 17
    record = json.loads((bin_path.parent / "corpus.bin.verified").read_text())
    assert record["bin_mtime_ns"] == PAST and record["max_token"] == 700
    with monkeypatch.context() as patch:  # a second check reads only the record: nothing is hashed
        patch.setattr(indexed, "hashlib", types.SimpleNamespace(sha256=lambda: pytest.fail("re-hashed")))
        check_indexed(corpus)
    data = bytearray(bin_path.read_bytes())
    data[5] ^= 0x01  # same size, one flipped bit
    bin_path.write_bytes(bytes(data))
    os.utime(bin_path, ns=(PAST + 1, PAST + 1))
    with pytest.raises(ValueError, match=r"corpus.bin is corrupt: its SHA-256 differs"):
        check_indexed(corpus)


def test_a_fresh_file_is_verified_but_not_cached(corpus):
    check_indexed(corpus)  # just written: its mtime may still move within the clock's granularity
    assert not (corpus.parent / "corpus.bin.verified").exists()


def test_out_of_range_token_names_file_document_and_token(corpus):
    check_indexed(corpus, vocab_size=701)
    with pytest.raises(ValueError, match=r"corpus.bin: document 2 holds token id 700 \(its token 2\), outside the "
                                         r"vocabulary \[0, 500\)"):
        check_indexed(corpus, vocab_size=500)


def test_truncated_bin_and_wrong_magic_fail_the_pre_start_check(corpus):
    bin_path, idx_path = data_paths(corpus)
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"corpus.bin is truncated"):
        check_indexed(corpus)
    idx_path.write_bytes(b"NOTMZIDX" + idx_path.read_bytes()[8:])
    with pytest.raises(ValueError, match=r"corpus.idx is not a megazoo indexed dataset index: wrong magic"):
        check_indexed(corpus)


@pytest.fixture
def no_merges(tmp_path, data_dir):
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    shutil.copy(data_dir / "gpt2_bpe" / "encoder.json", bpe / "vocab.json")
    (bpe / "merges.txt").write_text("#version: 0.2\n")
    return bpe


def test_a_tokenizer_without_merges_is_refused_naming_the_file(no_merges, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"merges file .*bpe/merges.txt holds no merges"):
        check_tokenizer_spec(no_merges)  # what the recipe resolver calls before any process starts
    with pytest.raises(ValueError, match=r"bpe/merges.txt holds no merges"):
        GPT2BPETokenizer.from_dir(no_merges)
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "Hello world"}\n')
    assert preprocess_main(["--input", str(source), "--tokenizer", str(no_merges), "--output-prefix",
                            str(tmp_path / "out"), "--workers", "1"]) == 2
    assert "merges.txt holds no merges" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))


def test_a_tokenizers_json_without_merges_is_refused(tmp_path):
    path = tmp_path / "tok.json"
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}))
    with pytest.raises(ValueError, match=r"tok.json is a BPE tokenizer without merges"):
        check_tokenizer_spec(path)


@pytest.mark.parametrize("content", ["", "\n\n   \n"], ids=["empty", "blank-lines"])
def test_preprocess_of_an_empty_jsonl_exits_2_naming_the_file(tmp_path, data_dir, capsys, content):
    source = tmp_path / "empty.jsonl"
    source.write_text(content)
    assert preprocess_main(["--input", str(source), "--tokenizer", str(data_dir / "gpt2_bpe"),
                            "--output-prefix", str(tmp_path / "out"), "--workers", "1"]) == 2
    assert str(source) in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))


def test_preprocess_outputs_get_the_normal_umask(tmp_path, data_dir):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "Hello world"}\n')
    old = os.umask(0o022)
    try:
        assert preprocess_main(["--input", str(source), "--tokenizer", str(data_dir / "gpt2_bpe"),
                                "--output-prefix", str(tmp_path / "out"), "--workers", "1"]) == 0
    finally:
        os.umask(old)
    for path in data_paths(tmp_path / "out"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("evalckpt")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=50257, initializer_range=0.1)
    GPT2LMHeadModel(cfg).save_pretrained(str(root / "hf"))
    assert megazoo(["convert", "hf-to-megazoo", root / "hf", "--out", root / "ckpt"]) == 0
    return root / "ckpt"


def test_eval_records_the_checkpoint_it_evaluated(tiny_checkpoint, tmp_path, data_dir):
    out = tmp_path / "result.json"
    assert megazoo(["eval", "lambada", "--checkpoint", tiny_checkpoint, "--tokenizer", data_dir / "gpt2_bpe",
                    "--data", data_dir / "lambada" / "lambada_test.jsonl", "--limit", 2, "--json", out]) == 0
    result = json.loads(out.read_text())
    assert result["checkpoint"] == str((tiny_checkpoint / "step_00000000").resolve())
    assert result["checkpoint_step"] == 0


def test_eval_tp2_with_malformed_data_exits_2_before_torchrun(tiny_checkpoint, tmp_path, data_dir, monkeypatch,
                                                             capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine line"}\n{"text": broken\n')
    monkeypatch.setattr(launcher, "launch_local", lambda *a, **k: pytest.fail("torchrun was started"))
    assert megazoo(["eval", "lambada", "--checkpoint", tiny_checkpoint, "--tokenizer", data_dir / "gpt2_bpe",
                    "--data", bad, "--tp", 2]) == 2
    assert f"{bad}, line 2: not valid JSON" in capsys.readouterr().err
