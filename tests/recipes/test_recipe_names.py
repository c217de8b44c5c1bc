"""Issue 15 item 4: shipped recipes by name (`megazoo train demo`, `megazoo recipes`) from any directory, data
paths relative to the recipe file or --data-dir, and run.dir/recipe.resolved.toml (every field, re-loadable,
never written over an earlier, different one)."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import numpy as np
import pytest
from recipe_helpers import tiny_resolved

from megazoo.data.indexed.dataset import IndexedDatasetWriter
from megazoo.recipes.catalog import find_recipe, shipped_recipes
from megazoo.recipes.cli import main as cli_main
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.resolved_toml import resolved_toml
from megazoo.recipes.training.run_dir import write_resolved_recipe

REPO = Path(__file__).resolve().parents[2]


def test_shipped_recipes_are_the_package_data(monkeypatch, tmp_path, capsys):
    shipped = shipped_recipes()
    assert set(shipped) == {p.stem for p in (REPO / "recipes").glob("*.toml")}
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.toml" in package_data["megazoo.recipes"]  # so a wheel carries them
    monkeypatch.chdir(tmp_path)  # outside the repository
    assert find_recipe("demo") == find_recipe("demo.toml") == find_recipe("recipes/demo.toml") == shipped["demo"]
    own = tmp_path / "demo.toml"
    own.write_text("[train]\nsteps = 1\n")
    assert find_recipe("demo.toml") == Path("demo.toml")  # a user's own file wins over the shipped name
    with pytest.raises(RecipeError, match="neither a file nor a shipped recipe; shipped: deepseek-demo, deepseek-v3, demo"):
        find_recipe("nosuch")
    assert cli_main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:len(shipped)]] == list(shipped)
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines[:len(shipped)])  # a description each
    demo = lines[list(shipped).index("demo")]
    assert demo.startswith("demo ") and "gpt2-tiny" in demo
    # `megazoo train demo` from here: the recipe is found and checked (a bad override proves it was parsed)
    assert cli_main(["train", "demo", "--set", "train.steps=0"]) == 2
    assert "train.steps = 0 is invalid" in capsys.readouterr().err


def _corpus(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(folder / "corpus", 300) as writer:
        writer.add_document(np.arange(200) % 300)


def test_data_paths_are_relative_to_the_recipe_or_data_dir(monkeypatch, tmp_path):
    project = tmp_path / "project"
    _corpus(project)
    recipe = project / "r.toml"
    recipe.write_text('[data]\nsource = "indexed"\npaths = ["corpus"]\n[model]\nvocab_size = 300\n')
    monkeypatch.chdir(tmp_path)
    assert load_recipe(recipe).data.paths == (str(project / "corpus"),)  # beside the recipe, from anywhere
    elsewhere = tmp_path / "elsewhere"
    _corpus(elsewhere)
    assert load_recipe(recipe, data_dir=elsewhere).data.paths == (str(elsewhere / "corpus"),)
    assert load_recipe(recipe, ["data.paths=['x/corpus']"]).data.paths == ("x/corpus",)  # --set: as typed
    with pytest.raises(RecipeError, match="--data-dir .* is not a folder"):
        load_recipe(recipe, data_dir=tmp_path / "missing")
    # a recipe written relative to the current directory (the old convention) still finds its data
    cwd_recipe = project / "sub" / "cwd.toml"
    cwd_recipe.parent.mkdir()
    cwd_recipe.write_text('[data]\nsource = "indexed"\npaths = ["elsewhere/corpus"]\n')
    assert load_recipe(cwd_recipe).data.paths == (str(elsewhere / "corpus"),)


def test_resolved_recipe_has_every_field_and_loads_back(tmp_path):
    res = tiny_resolved(train={"grad_accum": 2}, run={"dir": str(tmp_path / "run")})
    text = resolved_toml(res)
    table = tomllib.loads(text)
    assert table["model"]["d_ff"] == 512 and table["model"]["vocab_size"] == 300 and table["model"]["n_head"] == 4
    assert table["train"]["global_batch"] == 8 and table["train"]["lr_decay_steps"] == 10
    assert set(table["zero"]) == {f.name for f in dataclasses.fields(res.recipe.zero)}
    (tmp_path / "run-files").mkdir()
    path = write_resolved_recipe(tmp_path / "run-files", text)
    again = resolve(load_recipe(path))
    assert again.model == res.model and again.global_batch == res.global_batch
    assert again.recipe.train == dataclasses.replace(res.recipe.train, global_batch=8, lr_decay_steps=10)
    assert again.recipe.data == res.recipe.data and again.recipe.parallel == res.recipe.parallel
    # a resumed job with other settings keeps the earlier file beside the new one
    assert write_resolved_recipe(path.parent, text, 5) == path and not list(path.parent.glob("*before*"))
    write_resolved_recipe(path.parent, text.replace("steps = 10", "steps = 20"), 10)
    kept = path.parent / "recipe.resolved.before-step_10.toml"
    assert kept.read_text() == text and "steps = 20" in path.read_text()
