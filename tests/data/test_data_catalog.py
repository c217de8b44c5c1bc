"""The data catalog (data/published/catalog.py): its hashes are the data's, its lookup order is --data-dir, $MEGAZOO_DATA_DIR,
the user cache; a recipe's `data.tokenizer = "gpt2-bpe"` resolves through it from any folder, and a missing one
says how to get it while planning still works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megazoo.data.published.catalog import CATALOG, cache_folder, default_folders, fetch_folder, find_item
from megazoo.data.fileio import file_sha256
from megazoo.recipes import cli
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.resolve import model_config, resolve_for_planning

TNLG = Path(__file__).resolve().parents[2] / "recipes" / "tnlg-17b.toml"


def test_every_catalog_file_has_its_published_hash_and_size(data_dir):
    for item in CATALOG.values():
        assert item.found_in(data_dir) == data_dir / item.folder
        for file in item.files:
            for name in file.names:  # OpenAI's and Hugging Face's names of the same bytes
                if (data_dir / item.folder / name).is_file():
                    path = data_dir / item.folder / name
                    assert (file_sha256(path), path.stat().st_size) == (file.sha256, file.size), path
            assert all(s.url.startswith("https://") for s in file.sources)


def test_the_lookup_order_is_data_dir_env_then_cache(tmp_path):
    env = {"MEGAZOO_DATA_DIR": "/data/zoo", "XDG_CACHE_HOME": "/xdg", "HOME": "/home/u"}
    assert default_folders(env) == [Path("/data/zoo"), Path("/xdg/megazoo/data")]
    assert fetch_folder(env) == Path("/data/zoo")
    assert default_folders({"HOME": "/home/u"}) == [Path("/home/u/.cache/megazoo/data")]
    assert cache_folder({"HOME": "/home/u", "XDG_CACHE_HOME": "relative"}) == Path("/home/u/.cache/megazoo/data")
    assert fetch_folder({"HOME": "/home/u", "MEGAZOO_DATA_DIR": ""}) == Path("/home/u/.cache/megazoo/data")
    first, second, partial = tmp_path / "first", tmp_path / "second", tmp_path / "partial"
    for folder in (first, second):
        (folder / "lambada").mkdir(parents=True)
        (folder / "lambada" / "lambada_test.jsonl").write_text("{}\n")
    (partial / "gpt2_bpe").mkdir(parents=True)
    (partial / "gpt2_bpe" / "vocab.json").write_text("{}")  # no merges: not the item
    (second / "gpt2_bpe").mkdir()
    for name in ("vocab.json", "merges.txt"):  # Hugging Face's names count too
        (second / "gpt2_bpe" / name).write_text("x")
    assert find_item("lambada", [first, second]) == first / "lambada"
    assert find_item("gpt2-bpe", [first, partial, second]) == second / "gpt2_bpe"
    assert find_item("wikitext103", [first, second]) is None


def test_a_recipe_names_its_tokenizer_from_the_catalog(data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # away from the checkout: nothing resolves against the current folder
    found = str((data_dir / "gpt2_bpe").resolve())
    assert load_recipe(TNLG).data.tokenizer == "gpt2-bpe"  # no folder given: the name stays
    assert load_recipe(TNLG, data_dir=data_dir).data.tokenizer == found
    assert load_recipe(TNLG, catalog_dirs=[tmp_path / "empty", data_dir]).data.tokenizer == found
    other = tmp_path / "other.toml"
    other.write_text('[data]\nsource = "indexed"\ntokenizer = "my-tok"\n')
    assert load_recipe(other, ["data.tokenizer=gpt2-bpe"], catalog_dirs=[data_dir]).data.tokenizer == found
    recipe = load_recipe(TNLG, ["data.source=synthetic"], catalog_dirs=[data_dir])
    assert model_config(recipe).vocab_size == 50257  # the real tokenizer's


def test_a_missing_catalog_tokenizer_says_how_to_get_it_and_planning_still_works(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(TNLG, catalog_dirs=[tmp_path / "empty"])
    with pytest.raises(RecipeError) as info:
        model_config(recipe)
    msg = str(info.value)
    assert msg.startswith("data.tokenizer = 'gpt2-bpe': ")
    assert "`megazoo data fetch gpt2-bpe`" in msg and "--data-dir DIR" in msg and "MEGAZOO_DATA_DIR" in msg
    assert resolve_for_planning(recipe).model.vocab_size == 50257  # the preset states it


def test_megazoo_train_looks_in_megazoo_data_dir_then_the_cache(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEGAZOO_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cli.main(["train", "tnlg-17b"]) == 2
    assert "`megazoo data fetch gpt2-bpe`" in capsys.readouterr().err
    shutil.copytree(data_dir / "gpt2_bpe", tmp_path / "cache" / "megazoo" / "data" / "gpt2_bpe")  # as fetched
    assert cli.main(["train", "tnlg-17b"]) == 2  # now past the tokenizer, to the user's corpus
    err = capsys.readouterr().err
    assert "data.paths" in err and "corpus_text_document" in err and "gpt2-bpe" not in err
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("MEGAZOO_DATA_DIR", str(tmp_path / "cache" / "megazoo" / "data"))
    assert cli.main(["train", "tnlg-17b"]) == 2
    assert "corpus_text_document" in capsys.readouterr().err


def test_plan_of_a_shipped_recipe_from_any_folder_without_data(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEGAZOO_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cli.main(["plan", "--recipe", "recipes/tnlg-17b.toml", "--gpu", "v100-32gb"]) == 0
    assert "fits: yes" in capsys.readouterr().out


def test_the_suite_skips_without_data_and_fails_when_data_is_required(tmp_path, data_dir):
    """tests/conftest.py's data_dir fixture, in a suite of its own whose ../shared/data does not exist."""
    suite = tmp_path / "suite" / "tests"
    suite.mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "conftest.py", suite / "conftest.py")
    (suite / "test_needs_data.py").write_text("def test_reads(data_dir):\n    assert data_dir.is_dir()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MEGAZOO_DATA_DIR", "MEGAZOO_REQUIRE_DATA")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")

    def pytest_run(extra: dict, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args, "tests"],
                              cwd=suite.parent, env={**env, **extra}, capture_output=True, text=True, timeout=600)

    skipped = pytest_run({})
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout
    reason = next(line for line in skipped.stdout.splitlines() if line.startswith("SKIPPED"))
    assert "no evaluation data in ../shared/data" in reason and "run `megazoo data fetch all`" in reason
    failed = pytest_run({"MEGAZOO_REQUIRE_DATA": "1"})
    assert failed.returncode == 1 and "MEGAZOO_REQUIRE_DATA=1: missing data fails" in failed.stdout, failed.stdout
    found = pytest_run({"MEGAZOO_DATA_DIR": str(data_dir)})  # a later folder of the lookup holds it
    assert found.returncode == 0 and "1 passed" in found.stdout, found.stdout
    wrong = pytest_run({"MEGAZOO_DATA_DIR": str(data_dir)}, "--data-dir", str(tmp_path))  # given, and wrong: fails
    assert wrong.returncode == 1 and f"--data-dir {tmp_path} lacks wikitext103, lambada, gpt2-bpe" in wrong.stdout
