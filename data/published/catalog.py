"""The published data megazoo evaluates and tokenizes with, by name, and where a named item is looked for.

Names (`megazoo data fetch NAME`, and `data.tokenizer = "gpt2-bpe"` in a recipe):
- `wikitext103`: WikiText-103 test and validation, word level (wiki.test.tokens, wiki.valid.tokens), and the raw
  test text lm-eval reads (wiki.test.raw);
- `lambada`: LAMBADA test, OpenAI's detokenized version (lambada_test.jsonl);
- `gpt2-bpe`: OpenAI's GPT-2 BPE files (encoder.json + vocab.bpe; Hugging Face names them vocab.json + merges.txt,
  the same bytes).
Each file has its published SHA-256 (the hashes tiktoken pins for GPT-2, the one on EleutherAI's lambada_openai
card, the original WikiText release's) and the places it is published, tried in order. A data folder lays the
items out as `FOLDER/wikitext103/`, `FOLDER/lambada/`, `FOLDER/gpt2_bpe/`.

Lookup order for a named item: an explicit `--data-dir`, then `$MEGAZOO_DATA_DIR`, then the user cache folder
(`$XDG_CACHE_HOME/megazoo/data`, else `~/.cache/megazoo/data`, where `megazoo data fetch` stores). This module
reads no environment variable itself (DESIGN principle 1): a command line passes `os.environ` to
`default_folders`, and the folders on to whoever looks an item up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "MEGAZOO_DATA_DIR"

_HF = "https://huggingface.co"
_OPENAI = "https://openaipublic.blob.core.windows.net/gpt-2"
_WIKITEXT = f"{_HF}/datasets/Salesforce/wikitext/resolve/main"


@dataclass(frozen=True)
class Source:
    """One place a file is published. `kind`: "file" (the bytes as published) or "parquet-lines" (a Hugging Face
    datasets parquet with one `text` row per line of the original file, as the `wikitext` dataset stores it)."""

    url: str
    kind: str = "file"


@dataclass(frozen=True)
class DataFile:
    names: tuple[str, ...]  # the name fetch writes first; other names the same bytes go by (any one counts)
    sha256: str
    size: int
    sources: tuple[Source, ...]

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class DataItem:
    name: str
    folder: str  # its folder inside a data folder
    what: str
    files: tuple[DataFile, ...]

    def found_in(self, folder: Path) -> Path | None:
        """`folder/self.folder` when every file of the item is there (under one of its names), else None."""
        place = Path(folder) / self.folder
        if all(any((place / n).is_file() for n in f.names) for f in self.files):
            return place
        return None


CATALOG: dict[str, DataItem] = {item.name: item for item in (
    DataItem("wikitext103", "wikitext103",
             "WikiText-103 test + validation, word level, and the raw test text (CC BY-SA 3.0)", (
        DataFile(("wiki.test.tokens",), "56db52eb157b1ab5c89646eef70510c1eca6e12a3bfdb99f0d6b05b4eacb75b9",
                 1_281_077, (Source(f"{_WIKITEXT}/wikitext-103-v1/test-00000-of-00001.parquet", "parquet-lines"),)),
        DataFile(("wiki.valid.tokens",), "9aee9f52d6e77de6c7751fc5e7c44287db3ec0eaf15477098acc6b93c1c4250b",
                 1_142_309, (Source(f"{_WIKITEXT}/wikitext-103-v1/validation-00000-of-00001.parquet",
                                    "parquet-lines"),)),
        # the raw (untokenized) test text, the same for WikiText-2 and -103: lm-eval's wikitext task reads it
        DataFile(("wiki.test.raw",), "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
                 1_290_590, (Source(f"{_WIKITEXT}/wikitext-103-raw-v1/test-00000-of-00001.parquet",
                                    "parquet-lines"),)),
    )),
    DataItem("lambada", "lambada", "LAMBADA test, OpenAI's detokenized version, 5,153 examples (CC BY 4.0)", (
        DataFile(("lambada_test.jsonl",), "4aa8d02cd17c719165fc8a7887fddd641f43fcafa4b1c806ca8abc31fabdb226",
                 1_819_752, (Source(f"{_HF}/datasets/EleutherAI/lambada_openai/resolve/main/data/lambada_test.jsonl"),
                             Source(f"{_OPENAI}/data/lambada_test.jsonl"))),
    )),
    DataItem("gpt2-bpe", "gpt2_bpe", "OpenAI's GPT-2 BPE vocabulary + merges, 50,257 tokens (modified MIT)", (
        DataFile(("encoder.json", "vocab.json"), "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
                 1_042_301, (Source(f"{_OPENAI}/encodings/main/encoder.json"),
                             Source(f"{_HF}/openai-community/gpt2/resolve/main/vocab.json"))),
        DataFile(("vocab.bpe", "merges.txt"), "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                 456_318, (Source(f"{_OPENAI}/encodings/main/vocab.bpe"),
                           Source(f"{_HF}/openai-community/gpt2/resolve/main/merges.txt"))),
    )),
)}


def cache_folder(environ: Mapping[str, str]) -> Path:
    """The user cache folder for megazoo's data: `$XDG_CACHE_HOME/megazoo/data`, else `~/.cache/megazoo/data`
    (XDG: an unset, empty or relative XDG_CACHE_HOME means ~/.cache)."""
    xdg = environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path(environ.get("HOME") or Path.home()) / ".cache"
    return base / "megazoo" / "data"


def default_folders(environ: Mapping[str, str]) -> list[Path]:
    """Where a named item is looked for after an explicit --data-dir: $MEGAZOO_DATA_DIR, then the cache folder."""
    folders = [Path(environ[DATA_DIR_ENV])] if environ.get(DATA_DIR_ENV) else []
    return [*folders, cache_folder(environ)]


def fetch_folder(environ: Mapping[str, str]) -> Path:
    """Where `megazoo data fetch` stores without --dir: $MEGAZOO_DATA_DIR, else the cache folder."""
    return default_folders(environ)[0]


def find_item(name: str, folders: Sequence[str | Path]) -> Path | None:
    """The folder holding catalog item `name` (every file present), from the first of `folders` that has it."""
    item = CATALOG[name]
    for folder in folders:
        if (place := item.found_in(Path(folder))) is not None:
            return place
    return None


def missing_hint(name: str) -> str:
    """What to do when catalog item `name` is found nowhere."""
    item = CATALOG[name]
    return (f"{name!r} ({item.what.split(' (')[0]}) is in no data folder (--data-dir, ${DATA_DIR_ENV}, the cache "
            f"folder): fetch it with `megazoo data fetch {name}` (into ${DATA_DIR_ENV}, else ~/.cache/megazoo/data), "
            f"or pass --data-dir DIR (a folder holding {item.folder}/), or set {DATA_DIR_ENV}=DIR")
