"""Issue 15 item 1: with data.source = "indexed" the model's vocabulary follows data.tokenizer (as the stdlib
source's follows its BPE), a model.vocab_size smaller than the tokenizer is refused before any process starts,
and without a tokenizer the data's token ids are checked against the model's vocabulary."""

from __future__ import annotations

import json

import pytest
from recipe_helpers import tiny_resolved

from megazoo.data.indexed.preprocess import preprocess
from megazoo.data.tokenizers.tokenizer import BPETokenizer
from megazoo.recipes.config import RecipeError

TEXTS = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7} times." for i in range(200)]


@pytest.fixture(scope="module")
def own_corpus(tmp_path_factory):
    """A 300-token BPE trained on a small corpus, and that corpus preprocessed with it."""
    root = tmp_path_factory.mktemp("vocab")
    tokenizer = BPETokenizer.train(TEXTS, 300)
    tokenizer.save(root / "tok.json")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    preprocess([corpus], tokenizer, root / "corpus", progress=False)
    return root, tokenizer.vocab_size


def _resolve(root, tmp_path, model=None, tokenizer=True):
    data = {"source": "indexed", "paths": [str(root / "corpus")]}
    if tokenizer:
        data["tokenizer"] = str(root / "tok.json")
    return tiny_resolved(data=data, model={"vocab_size": None, **(model or {})}, run={"dir": str(tmp_path / "r")})


def test_vocabulary_follows_the_tokenizer(own_corpus, tmp_path):
    root, vocab = own_corpus
    assert vocab == 300
    res = _resolve(root, tmp_path)
    assert res.model.vocab_size == vocab  # not the preset's 50,257
    assert res.padded_vocab == 384
    bigger = _resolve(root, tmp_path, model={"vocab_size": 512})  # an explicit, larger vocabulary is kept
    assert bigger.model.vocab_size == 512


def test_smaller_model_vocabulary_than_the_tokenizer_is_refused(own_corpus, tmp_path):
    root, _ = own_corpus
    with pytest.raises(RecipeError, match=r"model.vocab_size = 200 is smaller than the 300 tokens of data.tokenizer"):
        _resolve(root, tmp_path, model={"vocab_size": 200})


def test_without_a_tokenizer_token_ids_beyond_the_model_are_refused(own_corpus, tmp_path):
    root, _ = own_corpus
    assert _resolve(root, tmp_path, tokenizer=False).model.vocab_size == 50257  # the preset's; ids fit
    with pytest.raises(RecipeError) as err:
        _resolve(root, tmp_path, model={"vocab_size": 260}, tokenizer=False)
    message = str(err.value)
    assert "data.paths" in message and "outside the vocabulary [0, 260)" in message
    assert "data.tokenizer" in message and "model.vocab_size" in message
