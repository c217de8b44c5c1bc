"""`load_tokenizer(spec)`: the one entry point that turns a user's tokenizer argument into a `Tokenizer`:

- a directory with GPT-2's BPE files (vocab.json + merges.txt, or encoder.json + vocab.bpe) -> GPT2BPETokenizer
- a `tokenizers` `.json` file (e.g. written by `megazoo tokenizer train --type bpe`) -> BPETokenizer
- a sentencepiece `.model` file (e.g. from `megazoo tokenizer train --type sentencepiece`) -> SentencePieceTokenizer
- `hf:NAME` or `hf:/path/to/dir` -> `transformers.AutoTokenizer.from_pretrained(NAME)` as an HFTokenizer
  (eod = its eos token). NAME is looked up in the local Hugging Face cache first, then on the hub.

`check_tokenizer_spec(spec)` validates a spec without loading it; `tokenizer_vocab_size(spec)` is the
vocabulary a recipe's model takes from its tokenizer (loaded once per spec and file version). This module sits above every tokenizer module
(it imports them; none imports it), so the tokenizer modules form no import circle.
"""

from __future__ import annotations

import functools
from pathlib import Path

from megazoo.data.published.catalog import CATALOG, missing_hint
from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer, check_merges_file, find_bpe_files
from megazoo.data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer
from megazoo.data.tokenizers.tokenizer import HF_PREFIX, BPETokenizer, HFTokenizer, Tokenizer


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
    if path.is_dir():  # GPT-2 BPE files, with at least one merge
        check_merges_file(find_bpe_files(path)[1])
        return
    if text in CATALOG:  # a data catalog name the recipe loader found in no data folder
        raise FileNotFoundError(missing_hint(text))
    if not path.exists():
        looks_like_name = not path.suffix and not text.startswith((".", "/", "~"))
        hint = f" (for the Hugging Face tokenizer {text!r} write {HF_PREFIX}{text})" if looks_like_name else ""
        raise FileNotFoundError(f"tokenizer {path} not found{hint}: give a GPT-2 BPE directory, a tokenizers "
                                f".json file, a sentencepiece .model file or hf:NAME")
    if path.suffix not in (".json", ".model"):
        raise ValueError(f"tokenizer file {path} has an unsupported suffix {path.suffix!r}: use a tokenizers .json, "
                         f"a sentencepiece .model, a GPT-2 BPE directory or hf:NAME")
    if path.suffix == ".json":
        _check_tokenizer_json(path)


def _check_tokenizer_json(path: Path) -> None:
    """A tokenizers .json must parse, and a BPE model in it must have merges."""
    import json

    try:
        model = json.loads(path.read_text(encoding="utf-8")).get("model") or {}
    except (UnicodeDecodeError, ValueError, AttributeError) as error:
        raise ValueError(f"tokenizer file {path} is not a tokenizers JSON file: {error}") from None
    if isinstance(model, dict) and model.get("type") == "BPE" and not model.get("merges"):
        raise ValueError(f"tokenizer file {path} is a BPE tokenizer without merges: it would split text into "
                         "single characters")


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
        return GPT2BPETokenizer.from_dir(path)
    if path.suffix == ".model":
        return SentencePieceTokenizer.load(path)
    return BPETokenizer.load(path)


def tokenizer_vocab_size(spec: str | Path) -> int:
    """The vocabulary size (ids 0..n-1, added tokens included) of the tokenizer `spec` names. Loads it once per
    spec and file version (size and mtime), so the pre-start checks and every rank agree cheaply."""
    path = Path(str(spec))
    stamp = None
    if not str(spec).startswith(HF_PREFIX) and path.exists():
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())
    return _vocab_size(str(spec), stamp)


@functools.lru_cache(maxsize=16)
def _vocab_size(spec: str, stamp) -> int:
    return load_tokenizer(spec).vocab_size
