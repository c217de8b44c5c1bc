"""Tokenizers behind one small interface: encode, decode, the end-of-document id and the vocabulary size."""

from pathlib import Path
from typing import Protocol, runtime_checkable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and eval need from any tokenizer."""

    @property
    def eod_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) over a Hugging Face `tokenizers.Tokenizer`.

    Byte-level pre-tokenization with no normalizer makes decode(encode(s)) == s for every string.
    """

    def __init__(self, backend: tokenizers.Tokenizer, source: str = "<in memory>") -> None:
        eod_id = backend.token_to_id(EOD_TOKEN)
        if eod_id is None:
            raise ValueError(f"tokenizer {source} has no {EOD_TOKEN!r} token")
        # A literal "<|endoftext|>" inside a document is plain text, not a document boundary: only the data
        # pipeline inserts eod. (This flag is not saved in the json, so it is set on every construction.)
        backend.encode_special_tokens = True
        self._backend = backend
        self._eod_id = eod_id

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> "BPETokenizer":
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + 1:
            raise ValueError(f"vocab_size must be >= {len(alphabet) + 1} (256 bytes + eod), got {vocab_size}")
        backend = tokenizers.Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOD_TOKEN],
            initial_alphabet=alphabet,  # every byte is encodable even if the corpus never shows it
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
        return cls(backend)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for bad json
            raise ValueError(f"tokenizer file {path} is not a valid tokenizers json: {error}") from error
        return cls(backend, source=str(path))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    def to_json(self) -> str:
        return self._backend.to_str()

    @property
    def eod_id(self) -> int:
        return self._eod_id

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in parallel (Rust threads)."""
        return [encoding.ids for encoding in self._backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        # Keep eod in the output so decode(encode(s)) == s even when s has "<|endoftext|>" in it.
        return self._backend.decode(list(ids), skip_special_tokens=False)
