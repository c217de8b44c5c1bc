"""OpenAI's GPT-2 byte-level BPE, loaded from its two files, behind the `Tokenizer` protocol.

A GPT-2 tokenizer directory holds either Hugging Face's names (`vocab.json` + `merges.txt`) or OpenAI's
(`encoder.json` + `vocab.bpe`); the contents are identical. We build the tokenizer with `tokenizers`'
`BPE.from_file` and a ByteLevel pre-tokenizer/decoder, which gives the same ids as OpenAI's encoder and
tiktoken ("Hello world" -> [15496, 995]). We deliberately avoid `GPT2TokenizerFast(vocab_file=..., merges_file=...)`:
with transformers 5.x it silently builds an EMPTY tokenizer that encodes everything to [].
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from megazoo.data.tokenizers.tokenizer import EOD_TOKEN, BPETokenizer

# (vocabulary file, merges file) name pairs, Hugging Face's first.
FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))
GPT2_EOD_ID = 50256


def find_bpe_files(directory: str | Path) -> tuple[Path, Path]:
    """The (vocabulary, merges) files of a GPT-2 tokenizer directory, or a clear error naming what is missing."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist (or is not a directory)")
    for vocab_name, merges_name in FILE_PAIRS:
        vocab, merges = directory / vocab_name, directory / merges_name
        if vocab.is_file() and merges.is_file():
            return vocab, merges
    wanted = " or ".join(f"{v} + {m}" for v, m in FILE_PAIRS)
    present = sorted(p.name for p in directory.iterdir())[:10]
    raise FileNotFoundError(f"tokenizer directory {directory} has no GPT-2 BPE files: expected {wanted}; "
                            f"found {present or 'nothing'}")


class GPT2BPETokenizer(BPETokenizer):
    """GPT-2's BPE (50,257 ids, eod `<|endoftext|>` = 50256); encode adds no eod, decode is lossless."""

    @classmethod
    def from_dir(cls, directory: str | Path) -> "GPT2BPETokenizer":
        vocab, merges = find_bpe_files(directory)
        _check_vocab_json(vocab)
        check_merges_file(merges)
        try:
            bpe = models.BPE.from_file(str(vocab), str(merges))
        except Exception as error:  # tokenizers raises a bare Exception for unreadable merges
            raise ValueError(f"cannot read GPT-2 BPE files {vocab} and {merges}: {error}") from error
        backend = tokenizers.Tokenizer(bpe)
        # add_prefix_space=False: "Hello" at the start of a text is "Hello", not " Hello" (OpenAI's behaviour).
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        tokenizer = cls(backend, source=str(directory))
        if len(tokenizer.encode("Hello world")) == 0:  # the empty-tokenizer pitfall, should it ever come back
            raise ValueError(f"tokenizer built from {directory} encodes text to no tokens: the BPE files are broken")
        return tokenizer

    @property
    def vocab_size(self) -> int:
        # The eod token is an ordinary vocabulary entry here (not an added token), so the model vocabulary
        # is exactly the BPE vocabulary: 50,257 for GPT-2.
        return self._backend.get_vocab_size(with_added_tokens=False)


def check_merges_file(path: Path) -> None:
    """A merges file with no merge (empty, or only the `#version` header) would silently tokenize per byte."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip() and not line.startswith("#version"):
                    if len(line.split()) != 2:
                        raise ValueError(f"GPT-2 merges file {path} is corrupt: line {line.strip()[:40]!r} is not "
                                         "two symbols")
                    return
    except UnicodeDecodeError as error:
        raise ValueError(f"GPT-2 merges file {path} is not UTF-8 text: {error}") from error
    raise ValueError(f"GPT-2 merges file {path} holds no merges (empty or only a header): the tokenizer would "
                     "split text into single bytes")


def _check_vocab_json(path: Path) -> None:
    """Fail early, naming the file, when the vocabulary is not a JSON object that has the eod token."""
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"GPT-2 vocabulary file {path} is not valid JSON: {error}") from error
    if not isinstance(vocab, dict) or EOD_TOKEN not in vocab:
        raise ValueError(f"GPT-2 vocabulary file {path} has no {EOD_TOKEN!r} entry: it is not a GPT-2 vocabulary")
