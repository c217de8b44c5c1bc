"""The stdlib corpus, the BPE tokenizer, fixed-length token samples and the corpus cache."""

import multiprocessing
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import megazoo.data.token_dataset as token_dataset
from megazoo.data.stdlib_corpus import split_train_val, stdlib_documents
from megazoo.data.token_dataset import TokenSamples, build_stdlib_corpus, synthetic_tokens
from megazoo.data.tokenizers.tokenizer import BPETokenizer, Tokenizer

MAX_BYTES = 300_000
VOCAB = 512


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, str]]:
    return stdlib_documents(MAX_BYTES)


@pytest.fixture(scope="module")
def tokenizer(docs) -> BPETokenizer:
    return BPETokenizer.train([text for _, text in docs], VOCAB)


def test_documents_are_sorted_real_source_within_budget(docs):
    paths = [path for path, _ in docs]
    assert len(docs) >= 2 and paths == sorted(paths)
    assert all(path.endswith(".py") and "\\" not in path for path in paths)
    sizes = [len(text.encode("utf-8")) for _, text in docs]
    # Whole documents until the budget is reached: all but the last stay under it.
    assert sum(sizes[:-1]) < MAX_BYTES <= sum(sizes)
    assert any("def " in text for _, text in docs)


def test_skipped_directories_never_appear():
    skipped = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    paths = [path for path, _ in stdlib_documents()]
    assert len(paths) > 100
    assert not [p for p in paths if skipped & set(p.split("/")[:-1])]
    assert "os.py" in paths and "json/decoder.py" in paths


def test_split_is_disjoint_deterministic_and_order_independent(docs):
    train, val = split_train_val(docs, 0.3)
    assert train and val
    assert sorted(train + val) == sorted(text for _, text in docs)
    assert split_train_val(docs, 0.3) == (train, val)
    shuffled_train, shuffled_val = split_train_val(docs[::-1], 0.3)
    assert sorted(shuffled_train) == sorted(train) and sorted(shuffled_val) == sorted(val)
    # Reading more documents never moves a document across the split.
    bigger_train, bigger_val = split_train_val(stdlib_documents(3 * MAX_BYTES), 0.3)
    assert set(val) <= set(bigger_val) and set(train) <= set(bigger_train)


def test_split_forces_a_validation_document(docs):
    train, val = split_train_val(docs[:2], 0.0)
    assert len(train) == 1 and len(val) == 1


def test_round_trip_on_real_stdlib_text(tokenizer, docs):
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.vocab_size == VOCAB
    for _, text in docs:
        ids = tokenizer.encode(text)
        assert len(ids) < len(text.encode("utf-8")) / 1.5  # BPE actually merges
        assert tokenizer.decode(ids) == text


def test_round_trip_on_unseen_bytes_and_literal_eod(tokenizer):
    text = "naïve 日本語 🎉\r\n\t\x00 <|endoftext|> end"
    ids = tokenizer.encode(text)
    assert tokenizer.eod_id not in ids  # only the data pipeline inserts document boundaries
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode_batch([text, "x"]) == [ids, tokenizer.encode("x")]


def test_save_load_and_clear_errors(tokenizer, tmp_path):
    path = tmp_path / "tok.json"
    tokenizer.save(path)
    loaded = BPETokenizer.load(path)
    assert loaded.encode("def f(x):\n    return x") == tokenizer.encode("def f(x):\n    return x")
    assert loaded.eod_id == tokenizer.eod_id
    with pytest.raises(FileNotFoundError, match="missing.json"):
        BPETokenizer.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        BPETokenizer.load(tmp_path / "bad.json")


def test_token_samples_shapes_and_shared_boundary():
    tokens = synthetic_tokens(1000, vocab_size=50, seed=0)
    samples = TokenSamples(tokens, seq_len=16)
    assert len(samples) == (1000 - 1) // 16
    batch = samples.stack([0, 1, 5])
    assert batch.shape == (3, 17) and batch.dtype == torch.long
    assert torch.equal(batch[2], torch.from_numpy(tokens[80:97].astype(np.int64)))
    for i in range(len(samples) - 1):
        assert samples[i][-1] == samples[i + 1][0]
    assert samples[len(samples) - 1].shape == (17,)
    with pytest.raises(IndexError):
        samples[len(samples)]


def test_token_samples_error_names_counts():
    with pytest.raises(ValueError, match=r"10 tokens.*seq_len 10.*11"):
        TokenSamples(synthetic_tokens(10, 50, seed=0), seq_len=10)


def test_synthetic_tokens_deterministic():
    a = synthetic_tokens(100, 7, seed=3)
    assert np.array_equal(a, synthetic_tokens(100, 7, seed=3))
    assert not np.array_equal(a, synthetic_tokens(100, 7, seed=4))
    assert a.min() >= 0 and a.max() < 7


def test_corpus_cache_reuse_and_rebuild_on_new_vocab(tmp_path, monkeypatch):
    first = build_stdlib_corpus(tmp_path, VOCAB, MAX_BYTES, 0.2, seed=0)
    assert first.train_tokens.dtype == np.uint16
    assert first.tokenizer.decode(first.val_tokens.tolist()).count("<|endoftext|>") >= 1
    assert first.train_tokens[-1] == first.tokenizer.eod_id == first.val_tokens[-1]

    def fail_build(*args):
        raise AssertionError("cache entry exists: must load, not build")

    monkeypatch.setattr(token_dataset, "_build", fail_build)
    second = build_stdlib_corpus(tmp_path, VOCAB, MAX_BYTES, 0.2, seed=0)
    assert np.array_equal(first.train_tokens, second.train_tokens)
    assert np.array_equal(first.val_tokens, second.val_tokens)
    assert second.tokenizer.to_json() == first.tokenizer.to_json()
    monkeypatch.undo()

    rebuilt = build_stdlib_corpus(tmp_path, VOCAB * 2, MAX_BYTES, 0.2, seed=0)
    assert rebuilt.tokenizer.vocab_size == VOCAB * 2
    assert len(rebuilt.train_tokens) < len(first.train_tokens)  # bigger vocab, fewer tokens
    assert len(list(tmp_path.iterdir())) == 2  # two entries, no leftover temp directories


def test_corpus_build_that_loses_the_race_returns_the_published_entry(tmp_path, monkeypatch):
    # Another process's entry (here: one built with a different seed) appears while this one builds.
    other = build_stdlib_corpus(tmp_path / "other", VOCAB, MAX_BYTES, 0.2, seed=1)
    real_build = token_dataset._build

    def build_then_get_overtaken(*args):
        corpus = real_build(*args)
        shutil.copytree(next((tmp_path / "other").iterdir()), tmp_path / "mine" / entry_name)
        return corpus

    entry_name = next((tmp_path / "other").iterdir()).name.replace("-s1", "-s0")
    monkeypatch.setattr(token_dataset, "_build", build_then_get_overtaken)
    corpus = build_stdlib_corpus(tmp_path / "mine", VOCAB, MAX_BYTES, 0.2, seed=0)
    assert np.array_equal(corpus.train_tokens, other.train_tokens)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == [entry_name]


def _build_fingerprint(cache_dir: Path) -> tuple[str, bytes, bytes]:
    corpus = build_stdlib_corpus(cache_dir, VOCAB, MAX_BYTES, 0.2, seed=0)
    return corpus.tokenizer.to_json(), corpus.train_tokens.tobytes(), corpus.val_tokens.tobytes()


def test_two_processes_building_at_once_agree(tmp_path):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.map(_build_fingerprint, [tmp_path, tmp_path])
    assert results[0] == results[1] == _build_fingerprint(tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
