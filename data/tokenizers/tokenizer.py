"""Tokenizers behind one small interface: encode, decode, the end-of-document id and the vocabulary size.

`Tokenizer` (the protocol), `BPETokenizer` (a `tokenizers` byte-level BPE) and `HFTokenizer` (any
`transformers` tokenizer) live here; GPT-2's own BPE files and sentencepiece models have their modules
(data/tokenizers/gpt2_bpe.py, data/tokenizers/sentencepiece_tokenizer.py), and `load_tokenizer(spec)`, which turns a user's tokenizer
argument into any of them, lives in data/tokenizers/loading.py, above all of them: import it from there (this
module imports nothing of the loader, not even lazily, so the tokenizer modules and their loader form no circle).
"""

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megazoo.data.fileio import atomic_write_text, write_new_file  # noqa: F401  (write_new_file: moved to data.fileio)

EOD_TOKEN = "<|endoftext|>"
HF_PREFIX = "hf:"


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
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        """Train on `texts` (a list, or any iterator: it is consumed once, so a corpus can be streamed).
        The result depends only on the texts and vocab_size (same corpus -> same tokenizer)."""
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
        length = len(texts) if hasattr(texts, "__len__") else None  # only used for the (hidden) progress bar
        backend.train_from_iterator(texts, trainer=trainer, length=length)
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
        atomic_write_text(path, self.to_json())

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


class HFTokenizer:
    """A `transformers` tokenizer (anything `AutoTokenizer` loads) behind the protocol; eod is its eos token.

    Like BPETokenizer, encode adds no special tokens (no BOS/EOS: the data pipeline inserts eod) and treats a
    special token's literal text inside a document as plain text; decode keeps special tokens and does no
    "clean-up" of spaces, so decode(encode(s)) == s wherever the underlying tokenizer is lossless (GPT-2 is).
    """

    def __init__(self, backend, source: str = "<in memory>") -> None:
        if backend.eos_token_id is None:
            raise ValueError(f"Hugging Face tokenizer {source} has no eos token to use as end-of-document id")
        # Documents are encoded whole and cut into samples later: silence the "sequence length is longer than
        # the model's maximum" warning, which is about model inputs, not about corpus documents.
        backend.model_max_length = sys.maxsize
        self._backend = backend
        self.source = source

    @property
    def eod_id(self) -> int:
        return self._backend.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._backend)  # includes added tokens, which `backend.vocab_size` leaves out

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
