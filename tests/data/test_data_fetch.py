"""`megazoo data fetch` offline: a local HTTP server (http.server in a thread) serves the suite's data folder as a
mirror; faults injected per file (a flipped byte, a dropped connection, a stall) must leave nothing cached."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megazoo.data.published import fetch_cli
from megazoo.data.published.catalog import CATALOG, Source
from megazoo.data.published.fetch import FetchError, fetch_file, item_names, sweep_stale_temporaries
from megazoo.data.fileio import file_sha256

REPO = Path(__file__).resolve().parents[2]


def _handler(root: Path, faults: dict[str, str], extra: dict[str, bytes], release: threading.Event):
    class Mirror(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            rel = self.path.lstrip("/")
            body = extra.get(rel)
            if body is None:
                if not (root / rel).is_file():
                    self.send_error(404)
                    return
                body = (root / rel).read_bytes()
            fault = faults.get(rel)
            if fault == "corrupt":  # one flipped bit, full length
                body = body[:100] + bytes([body[100] ^ 1]) + body[101:]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if fault in ("drop", "stall"):  # half the promised bytes, then close (drop) or hang (stall)
                self.wfile.write(body[:len(body) // 2])
                self.wfile.flush()
                if fault == "stall":
                    release.wait(60)
                return
            self.wfile.write(body)
    return Mirror


@pytest.fixture
def mirror(data_dir):
    faults, extra, release = {}, {}, threading.Event()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(data_dir, faults, extra, release))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_port}", faults=faults, extra=extra)
    release.set()
    server.shutdown()
    server.server_close()


def _fetch(name: str, folder: Path, url: str) -> int:
    return fetch_cli.main(["fetch", name, "--dir", str(folder), "--mirror", url])


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_fetch_all_stores_every_file_with_its_published_hash(mirror, tmp_path, capsys):
    assert _fetch("all", tmp_path, mirror.url) == 0
    out = capsys.readouterr().out
    for item in CATALOG.values():
        assert f"{item.name}: {tmp_path / item.folder}" in out
        for file in item.files:
            path = tmp_path / item.folder / file.name
            assert path.stat().st_size == file.size and file_sha256(path) == file.sha256
        assert _left(tmp_path / item.folder) == sorted(f.name for f in item.files)  # no temporary left
    assert _fetch("gpt2-bpe", tmp_path, mirror.url) == 0  # a second fetch downloads nothing
    assert "present, sha256 ok" in capsys.readouterr().err


def test_a_corrupted_download_is_refused_with_both_hashes_and_nothing_is_cached(mirror, tmp_path, data_dir,
                                                                             capsys):
    mirror.faults["lambada/lambada_test.jsonl"] = "corrupt"
    assert _fetch("lambada", tmp_path, mirror.url) == 1
    err = capsys.readouterr().err
    body = bytearray((data_dir / "lambada" / "lambada_test.jsonl").read_bytes())
    body[100] ^= 1
    path, expected = tmp_path / "lambada" / "lambada_test.jsonl", CATALOG["lambada"].files[0].sha256
    assert f"{path} was not stored" in err and f"expected {expected}" in err
    assert f"sha256 {hashlib.sha256(bytes(body)).hexdigest()}" in err and "Traceback" not in err
    assert _left(tmp_path / "lambada") == []  # nothing cached, no temporary


def test_a_dropped_connection_leaves_no_partial_file(mirror, tmp_path, capsys):
    mirror.faults["gpt2_bpe/vocab.bpe"] = "drop"
    assert _fetch("gpt2-bpe", tmp_path, mirror.url) == 1
    err = capsys.readouterr().err
    assert "vocab.bpe was not stored" in err and "gpt2-bpe not stored" in err
    assert _left(tmp_path / "gpt2_bpe") == ["encoder.json"]  # the intact file stays, no part of the other


def test_a_damaged_cached_file_is_downloaded_again(mirror, tmp_path, capsys):
    (tmp_path / "gpt2_bpe").mkdir()
    (tmp_path / "gpt2_bpe" / "encoder.json").write_text("{}")
    assert _fetch("gpt2-bpe", tmp_path, mirror.url) == 0
    assert "does not match the published one" in capsys.readouterr().err
    assert file_sha256(tmp_path / "gpt2_bpe" / "encoder.json") == CATALOG["gpt2-bpe"].files[0].sha256


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "Ctrl-C"])
def test_a_stop_mid_download_leaves_no_partial_file(mirror, tmp_path, signum, code):
    mirror.faults["lambada/lambada_test.jsonl"] = "stall"
    # SIGINT as a terminal delivers it: a suite started in the background (CI, `make test &`) passes SIGINT on as
    # ignored, and Python then never raises KeyboardInterrupt, so the child gets the default disposition back.
    proc = subprocess.Popen([sys.executable, "-m", "megazoo.data.published.fetch_cli", "fetch", "lambada", "--dir",
                             str(tmp_path), "--mirror", mirror.url], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    folder, deadline = tmp_path / "lambada", time.monotonic() + 60
    while not any(name.endswith(".tmp") for name in _left(folder)):  # the download has begun
        assert proc.poll() is None and time.monotonic() < deadline, "fetch never started downloading"
        time.sleep(0.05)
    time.sleep(0.2)  # half the file is in the temporary now
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "no partial file was left" in err and "Traceback" not in err
    assert _left(folder) == []


def test_a_killed_fetchs_temporary_is_swept(mirror, tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "lambada"
    folder.mkdir()
    stale = folder / f".lambada_test.jsonl.{dead.stdout.strip()}-0badf00d.tmp"
    alive = folder / f".lambada_test.jsonl.{os.getpid()}-0badf00d.tmp"  # a fetch running now: left alone
    stale.write_bytes(b"part")
    alive.write_bytes(b"part")
    assert sweep_stale_temporaries(folder, ["lambada_test.jsonl"]) == [stale]
    alive.unlink()
    stale.write_bytes(b"part")
    assert _fetch("lambada", tmp_path, mirror.url) == 0
    assert _left(folder) == ["lambada_test.jsonl"]


def _hf_rows(path: Path) -> list[str]:
    """A WikiText file as the Hugging Face `wikitext` dataset stores it: a row per line with its newline, a
    blank line (a single space) as an empty row."""
    return ["" if not line.strip() else line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)]


def test_a_hugging_face_parquet_source_rebuilds_the_original_file(mirror, tmp_path, data_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "test.parquet"
    rows = _hf_rows(data_dir / "wikitext103" / "wiki.test.tokens")
    assert len(rows) == 4358 and rows.count("") == 1467  # the dataset's test split
    pq.write_table(pa.table({"text": rows}), parquet)
    mirror.extra["wikitext-103-v1/test.parquet"] = parquet.read_bytes()
    file, target = CATALOG["wikitext103"].files[0], tmp_path / "out"
    target.mkdir()
    source = Source(f"{mirror.url}/wikitext-103-v1/test.parquet", "parquet-lines")
    assert file_sha256(fetch_file(file, target, [source], log=lambda line: None)) == file.sha256
    pq.write_table(pa.table({"text": rows[:-1]}), parquet)  # a row short: refused, nothing stored
    mirror.extra["wikitext-103-v1/short.parquet"] = parquet.read_bytes()
    (target / file.name).unlink()
    with pytest.raises(FetchError, match=f"expected {file.sha256}"):
        fetch_file(file, target, [Source(f"{mirror.url}/wikitext-103-v1/short.parquet", "parquet-lines")],
                   log=lambda line: None)
    assert _left(target) == []


def test_unknown_names_and_unreachable_sources(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        fetch_cli.main(["fetch", "wikitext2", "--dir", str(tmp_path)])
    assert info.value.code == 2 and "invalid choice: 'wikitext2'" in capsys.readouterr().err
    with pytest.raises(FetchError, match="valid: wikitext103, lambada, gpt2-bpe, all"):
        item_names("wikitext2")
    assert _fetch("lambada", tmp_path, "http://127.0.0.1:9") == 1  # nothing listens on port 9
    err = capsys.readouterr().err
    assert "lambada_test.jsonl was not stored: http://127.0.0.1:9/lambada/lambada_test.jsonl: cannot reach " \
           "127.0.0.1:9 (" in err and "not stored: no network (could not reach 127.0.0.1:9)" in err
    assert not (tmp_path / "lambada").exists()  # no empty folder left behind


def test_offline_fetch_says_no_network_names_the_offline_ways_and_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """No network (every host's name lookup fails): each file's line names the URL and the host it could not reach,
    the closing line says "no network" and names --mirror URL and MEGAZOO_DATA_DIR / --dir, and the cache folder the
    fetch would have made is not there afterwards (it used to keep one empty folder per item)."""
    import socket
    import urllib.error

    def offline(url, timeout=None):
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr("megazoo.data.published.fetch.urllib.request.urlopen", offline)
    cache = tmp_path / "cache" / "megazoo" / "data"
    assert fetch_cli.main(["fetch", "all", "--dir", str(cache)]) == 1
    err = capsys.readouterr().err
    assert not (tmp_path / "cache").exists()
    wikitext = CATALOG["wikitext103"].files[0]
    assert f"{cache / 'wikitext103' / wikitext.name} was not stored: {wikitext.sources[0].url}: cannot reach " \
           "huggingface.co (Name or service not known)" in err
    closing = err.strip().splitlines()[-1]
    assert closing.startswith("megazoo data fetch: wikitext103, lambada, gpt2-bpe not stored: no network (could not "
                              "reach huggingface.co, openaipublic.blob.core.windows.net)")
    for way in ("--mirror URL", "file:///PATH", "MEGAZOO_DATA_DIR=PATH", "--dir PATH", "Nothing partial was stored"):
        assert way in closing, way
    assert "intact" not in err and "Traceback" not in err


def test_a_copy_on_disk_is_a_mirror(data_dir, tmp_path, capsys):
    """The offline answer the message gives: --mirror file:///PATH of a data folder's copy, checked as any mirror."""
    assert _fetch("gpt2-bpe", tmp_path, data_dir.resolve().as_uri()) == 0
    assert _left(tmp_path / "gpt2_bpe") == sorted(f.name for f in CATALOG["gpt2-bpe"].files)
    assert "sha256 ok (file://" in capsys.readouterr().err


def test_help_imports_no_torch():
    """The command's own modules (catalog, fetch_cli, and fetch once run) import only the standard library up front;
    the package's __init__ is bypassed here so that this checks them alone."""
    code = ("import sys, types; pkg = types.ModuleType('megazoo.data'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['megazoo.data'] = pkg\nfrom megazoo.data.published import fetch_cli, fetch\n"
            "try:\n    fetch_cli.main(['fetch', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(json.dumps(sorted(m for m in ('torch', 'numpy', 'tqdm', 'pyarrow') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json\n" + code, str(REPO / "data")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [] and "--mirror URL" in out.stdout
