"""Tokenizers behind one small interface: encode, decode, the end-of-document id and the vocabulary size.

`load_tokenizer(spec)` is the one entry point that turns a user's tokenizer argument into a `Tokenizer`:

- a directory with GPT-2's BPE files (vocab.json + merges.txt, or encoder.json + vocab.bpe) -> GPT2BPETokenizer
- a `tokenizers` `.json` file (e.g. written by `megazoo tokenizer train --type bpe`) -> BPETokenizer
- a sentencepiece `.model` file (e.g. from `megazoo tokenizer train --type sentencepiece`) -> SentencePieceTokenizer
- `hf:NAME` or `hf:/path/to/dir` -> `transformers.AutoTokenizer.from_pretrained(NAME)` as an HFTokenizer
  (eod = its eos token). NAME is looked up in the local Hugging Face cache first, then on the hub.
"""

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

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


def load_hf_tokenizer(name: str) -> HFTokenizer:
    """`AutoTokenizer.from_pretrained(name)` wrapped in the protocol; `name` is a hub name or a local directory.

    A hub name is tried in the local cache first (no network, no retries), then on the hub. When the hub
    cannot be reached (offline, or HF_HUB_OFFLINE=1) the error says so and asks for a local directory.
    """
    if not name:
        raise ValueError(f"tokenizer {HF_PREFIX!r} names no tokenizer: use hf:NAME (e.g. hf:gpt2) or hf:/path/to/dir")
    from transformers import AutoTokenizer  # slow import (seconds): only for hf: tokenizers

    local = Path(name).expanduser()
    if local.exists() or name.startswith((".", "/", "~")):  # hub names look like "gpt2" or "org/name"
        if not local.is_dir():
            raise FileNotFoundError(f"Hugging Face tokenizer directory {local} not found (or not a directory)")
        try:
            return HFTokenizer(AutoTokenizer.from_pretrained(str(local)), source=str(local))
        except Exception as error:  # transformers raises many types for a directory it cannot read
            raise ValueError(f"{local} is not a Hugging Face tokenizer directory that AutoTokenizer can load "
                             f"(for GPT-2 BPE files give the directory without {HF_PREFIX!r}): {error}") from error
    try:
        try:
            backend = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except OSError:
            backend = AutoTokenizer.from_pretrained(name)
    except Exception as error:  # transformers / huggingface_hub raise many types (OSError, HTTP, value errors)
        if _hub_unreachable(error):
            raise ConnectionError(
                f"cannot load Hugging Face tokenizer {name!r}: the Hugging Face hub could not be reached (offline, "
                f"or HF_HUB_OFFLINE=1) and {name!r} is not in the local cache. Pass a local directory instead: "
                f"hf:/path/to/dir (saved with save_pretrained) or a GPT-2 BPE directory (vocab.json + merges.txt)"
            ) from error
        raise ValueError(f"cannot load Hugging Face tokenizer {name!r}: {error}") from error
    return HFTokenizer(backend, source=f"{HF_PREFIX}{name}")


def _hub_unreachable(error: BaseException) -> bool:
    """True when `error` (or what caused it) says the hub could not be contacted and nothing was cached."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError, TimeoutError)):
            return True
        if type(error).__name__ in ("ConnectError", "ConnectTimeout", "ConnectionError"):  # httpx / requests
            return True
        error = error.__cause__ or error.__context__
    return False


def check_tokenizer_spec(spec: str | Path) -> None:
    """Cheap validation of a tokenizer spec without loading it (for recipe checks before any process starts):
    `hf:` specs are accepted as they are, paths must exist and be of a supported kind."""
    text = str(spec)
    if text.startswith(HF_PREFIX):
        if not text[len(HF_PREFIX):]:
            raise ValueError(f"tokenizer {text!r} names no tokenizer: use hf:NAME (e.g. hf:gpt2) or hf:/path/to/dir")
        return
    path = Path(spec)
    if path.is_dir():
        return  # which files it holds is checked on load, with a message listing them
    if not path.exists():
        looks_like_name = not path.suffix and not text.startswith((".", "/", "~"))
        hint = f" (for the Hugging Face tokenizer {text!r} write {HF_PREFIX}{text})" if looks_like_name else ""
        raise FileNotFoundError(f"tokenizer {path} not found{hint}: give a GPT-2 BPE directory, a tokenizers "
                                f".json file, a sentencepiece .model file or hf:NAME")
    if path.suffix not in (".json", ".model"):
        raise ValueError(f"tokenizer file {path} has an unsupported suffix {path.suffix!r}: use a tokenizers .json, "
                         f"a sentencepiece .model, a GPT-2 BPE directory or hf:NAME")


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """The tokenizer a user named (see the module docstring for the accepted specs).

    Raises FileNotFoundError / ValueError / ConnectionError (hub unreachable) naming the path or name.
    """
    text = str(spec)
    if text.startswith(HF_PREFIX):
        return load_hf_tokenizer(text[len(HF_PREFIX):])
    check_tokenizer_spec(spec)
    path = Path(spec)
    if path.is_dir():
        from megazoo.data.gpt2_bpe import GPT2BPETokenizer  # imported here: data.gpt2_bpe imports this module

        return GPT2BPETokenizer.from_dir(path)
    if path.suffix == ".model":
        from megazoo.data.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer.load(path)
    return BPETokenizer.load(path)


def write_new_file(path: str | Path, data: bytes) -> None:
    """Write `data` to `path`, which must not exist: all or nothing, and never over an existing file.

    The bytes go to a temporary file beside `path` that is then hard-linked into place (link fails when
    `path` exists, even if it appeared meanwhile), so a crash never leaves a half-written tokenizer.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists; not overwriting it (remove it or choose another output)")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise FileExistsError(f"{path} already exists; not overwriting it") from None
        except OSError:  # a filesystem without hard links: fall back to an exists-check + rename
            if path.exists():
                raise FileExistsError(f"{path} already exists; not overwriting it") from None
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
