"""Download catalog items (data/published/catalog.py) into a data folder, each file checked against its published SHA-256.

A file is streamed into a hidden temporary file in its target folder (data/fileio.py's AtomicFile), hashed on
the way, and renamed into place only when its SHA-256 is the published one: a reader never sees a part of a
file, a corrupted download is refused (FetchError naming the path, the expected and the actual hash) and leaves
nothing behind, and an interrupted one (a dropped connection, Ctrl-C, or SIGTERM turned into an exception by the
command line) leaves no partial file. Temporary files of a process that was killed outright (SIGKILL) are swept
by the next fetch into the same folder. A file already present with the right hash is not downloaded again.

`base_url` (tests, mirrors) replaces every published source by `BASE_URL/FOLDER/NAME`: a plain copy of a data
folder laid out as the catalog lays it out (e.g. `../shared/data` behind `python -m http.server`).
"""

from __future__ import annotations

import http.client
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

from megazoo.data.published.catalog import CATALOG, DataFile, DataItem, Source
from megazoo.data.fileio import AtomicFile, file_sha256

_BLOCK = 1 << 16
TIMEOUT_S = 60.0


class FetchError(RuntimeError):
    """A file that could not be fetched or did not match its published hash; nothing was stored for it.
    `unreachable`: the hosts every source tried and could not reach (no network, DNS, refused, timed out), when
    that was every source's failure; empty otherwise."""

    def __init__(self, message: str, unreachable: tuple[str, ...] = ()):
        super().__init__(message)
        self.unreachable = unreachable


def _unreachable_host(url: str, err: BaseException) -> str | None:
    """The host of `url` when `err` says it could not be reached at all (a failed name lookup, a refused or timed
    out connection): a network problem, not a file problem. An HTTP status or a bad hash is None."""
    if isinstance(err, urllib.error.HTTPError):
        return None
    reason = err.reason if isinstance(err, urllib.error.URLError) else err
    if isinstance(reason, (OSError, TimeoutError)) and not isinstance(reason, FileNotFoundError):
        parts = urllib.parse.urlsplit(url)
        return parts.netloc or None  # file:// mirrors have no host: a missing file there is not the network
    return None


def item_names(name: str) -> list[str]:
    """The catalog items `name` stands for ("all": every one), or FetchError listing the valid names."""
    if name == "all":
        return list(CATALOG)
    if name not in CATALOG:
        raise FetchError(f"unknown data item {name!r}; valid: {', '.join(CATALOG)}, all")
    return [name]


def fetch_item(item: DataItem, folder: Path, *, base_url: str | None = None, progress: bool = False,
               log: Callable[[str], None] = print) -> Path:
    """Fetch every file of `item` into `folder/item.folder`; returns that folder. A folder this call created and
    left empty (nothing could be fetched) is removed again: a failed fetch leaves no trace in the cache."""
    target = Path(folder) / item.folder
    created = [p for p in (target, *target.parents) if not p.exists()]  # deepest first
    target.mkdir(parents=True, exist_ok=True)
    try:
        sweep_stale_temporaries(target, (n for f in item.files for n in f.names))
        for file in item.files:
            sources = (Source(f"{base_url.rstrip('/')}/{item.folder}/{file.name}"),) if base_url else file.sources
            fetch_file(file, target, sources, progress=progress, log=log)
    finally:
        for made in created:
            try:
                made.rmdir()  # only an empty folder goes
            except OSError:
                break
    return target


def fetch_file(file: DataFile, target: Path, sources: Iterable[Source], *, progress: bool = False,
               log: Callable[[str], None] = print) -> Path:
    """`target/file.name` from the first of `sources` whose bytes have the published hash, else FetchError
    naming each source's failure (nothing is stored)."""
    path = target / file.name
    present = next((target / n for n in file.names if (target / n).is_file()), None)
    if present is not None:
        if file_sha256(present) == file.sha256:
            log(f"{present}: present, sha256 ok")
            return present
        log(f"{present}: sha256 does not match the published one; downloading it again")
    failures, unreachable = [], []
    for source in sources:
        try:
            actual = _download(source, path, file, progress)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:  # a short read too
            host = _unreachable_host(source.url, err)
            reason = getattr(err, "reason", None) or err
            reason = getattr(reason, "strerror", None) or reason
            failures.append(f"{source.url}: cannot reach {host} ({reason})" if host else f"{source.url}: {reason}")
            unreachable.append(host)
            continue
        if actual == file.sha256:
            log(f"{path}: {file.size:,} bytes, sha256 ok ({source.url})")
            return path
        failures.append(f"{source.url}: sha256 {actual}, expected {file.sha256} (refused: not stored)")
        unreachable.append(None)
    offline = tuple(dict.fromkeys(unreachable)) if unreachable and all(unreachable) else ()
    raise FetchError(f"{path} was not stored: " + "; ".join(failures), offline)


def _download(source: Source, path: Path, file: DataFile, progress: bool) -> str:
    """Download `source` into a temporary file beside `path`; rename it over `path` only when its sha256 is
    file.sha256. Returns the sha256 of what was downloaded."""
    out = AtomicFile(path)
    try:
        with urllib.request.urlopen(source.url, timeout=TIMEOUT_S) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            if source.kind == "parquet-lines":
                raw = AtomicFile(path.with_name(path.name + ".parquet"))
                try:
                    _copy(response, raw.file, total, progress, source.url)
                    raw.sync()
                    _parquet_lines(raw.tmp_path, out.file)
                finally:
                    raw.discard()
            else:
                received = _copy(response, out.file, total, progress, source.url)
                if total is not None and received != total:  # a dropped connection can end the stream early
                    raise OSError(f"connection closed after {received:,} of {total:,} bytes")
        out.sync()
        actual = file_sha256(out.tmp_path)
        if actual == file.sha256:
            out.commit()
        return actual
    finally:
        out.discard()


def _copy(response, sink, total: int | None, progress: bool, label: str) -> int:
    from tqdm import tqdm

    received = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc=label.rsplit("/", 1)[-1], disable=not progress,
              leave=False) as bar:
        while block := response.read(_BLOCK):
            sink.write(block)
            received += len(block)
            bar.update(len(block))
    return received


def _parquet_lines(parquet: Path, sink) -> None:
    """The original text file of a Hugging Face `wikitext`-style parquet: each `text` row is one line with its
    newline, and a blank line (a single space in the original files) is stored as an empty row."""
    import pyarrow.parquet as pq  # a dependency of `datasets`

    table = pq.read_table(parquet, columns=["text"])
    for row in table.column("text").to_pylist():
        sink.write((row if row else " \n").encode("utf-8"))


_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-[0-9a-f]+\.tmp$")


def sweep_stale_temporaries(folder: Path, names: Iterable[str]) -> list[Path]:
    """Remove AtomicFile temporaries of `names` in `folder` whose process is gone (e.g. killed by SIGKILL
    mid-download); a live process's temporary (another fetch running now) is left alone."""
    wanted, removed = set(names), []
    for entry in folder.iterdir():
        match = _TEMPORARY.match(entry.name)
        if not match or match["name"].removesuffix(".parquet") not in wanted:
            continue
        try:
            os.kill(int(match["pid"]), 0)
        except ProcessLookupError:
            entry.unlink(missing_ok=True)
            removed.append(entry)
        except PermissionError:  # alive, another user's
            pass
    return removed
