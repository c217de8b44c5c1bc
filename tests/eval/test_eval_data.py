"""The real evaluation data and the GPT-2 BPE: the README's known counts, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megazoo.data.tokenizers.tokenizer import Tokenizer
from megazoo.eval.detokenizer import wikitext_detokenize
from megazoo.eval.lambada import load_lambada, read_lambada_texts, split_last_word
from megazoo.eval.wikitext103 import load_wikitext


@pytest.fixture(scope="module")
def tokenizer(data_dir):
    return GPT2BPETokenizer.from_dir(data_dir / "gpt2_bpe")


@pytest.fixture(scope="module")
def wikitext(data_dir, tokenizer):
    return load_wikitext(data_dir / "wikitext103" / "wiki.test.tokens", tokenizer)


def test_gpt2_bpe_matches_openai(tokenizer):
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (50257, 50256)
    text = "Caf\u00e9 <|endoftext|> \u2014 \U0001f600  two  spaces\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert 50256 not in tokenizer.encode(text)  # the literal eod string is text, never a boundary


def test_both_file_namings_give_the_same_tokenizer(data_dir, tmp_path, tokenizer):
    hf_names = tmp_path / "hf_names"
    hf_names.mkdir()
    (hf_names / "vocab.json").write_bytes((data_dir / "gpt2_bpe" / "encoder.json").read_bytes())
    (hf_names / "merges.txt").write_bytes((data_dir / "gpt2_bpe" / "vocab.bpe").read_bytes())
    text = "The quick brown fox, 1,234 times."
    assert GPT2BPETokenizer.from_dir(hf_names).encode(text) == tokenizer.encode(text)


def test_raw_bpe_counts(data_dir, tokenizer):
    wiki = data_dir / "wikitext103"
    assert len(tokenizer.encode((wiki / "wiki.test.tokens").read_bytes().decode("utf-8"))) == 285_234
    assert len(tokenizer.encode((wiki / "wiki.test.raw").read_bytes().decode("utf-8"))) == 286_221


def test_wikitext103_counts(wikitext):
    assert wikitext.num_original_tokens == 245_566
    assert wikitext.num_bpe_tokens == 270_330
    assert round(wikitext.token_ratio, 6) == 1.100845
    assert wikitext.sha256 == "56db52eb157b1ab5c89646eef70510c1eca6e12a3bfdb99f0d6b05b4eacb75b9"


def test_detokenizer_rules():
    text = (" = = Early life = = \n He said \" it 's 1 @,@ 000 km ( 620 mi ) \" , "
            "a state @-@ of @-@ the @-@ art 3 @.@ 5 \N{DEGREE SIGN} C ; the players ' \n")
    assert wikitext_detokenize(text) == (
        " == Early life ==\nHe said \"it's 1,000 km (620 mi)\", a state-of-the-art 3.5\N{DEGREE SIGN}C; "
        "the players'\n")


def test_lambada_examples(data_dir, tokenizer):
    data = load_lambada(data_dir / "lambada" / "lambada_test.jsonl", tokenizer)
    assert len(data.examples) == 5_153
    assert data.sha256 == "4aa8d02cd17c719165fc8a7887fddd641f43fcafa4b1c806ca8abc31fabdb226"
    assert all(ex.context and ex.target for ex in data.examples)
    assert split_last_word("he saw the dog  and the dog") == ("he saw the dog  and the", "dog")


def test_tokenizer_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GPT2BPETokenizer.from_dir(tmp_path / "absent")
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"merges\.txt.*vocab\.bpe") as err:
        GPT2BPETokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(err.value)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="no '<|endoftext|>' entry"):
        GPT2BPETokenizer.from_dir(tmp_path)
    (tmp_path / "vocab.json").write_text("{broken")
    with pytest.raises(ValueError, match="vocab.json is not valid JSON"):
        GPT2BPETokenizer.from_dir(tmp_path)


def test_data_file_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="missing.tokens"):
        load_wikitext(tmp_path / "missing.tokens", tokenizer)
    binary = tmp_path / "corrupt.tokens"
    binary.write_bytes(b"\x80\x81\xfe\xff" * 100)
    with pytest.raises(ValueError, match="corrupt.tokens is not UTF-8"):
        load_wikitext(binary, tokenizer)
    empty = tmp_path / "empty.tokens"
    empty.write_text(" \n")
    with pytest.raises(ValueError, match="empty.tokens is empty"):
        load_wikitext(empty, tokenizer)

    jsonl = tmp_path / "lambada.jsonl"
    jsonl.write_text(json.dumps({"text": "a b c"}) + "\n" + json.dumps({"txt": "x y"}) + "\n")
    with pytest.raises(ValueError, match=r"lambada.jsonl, line 2: no \"text\" field"):
        read_lambada_texts(jsonl)
    jsonl.write_text(json.dumps({"text": "a b c"}) + "\n{truncated\n")
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        read_lambada_texts(jsonl)
