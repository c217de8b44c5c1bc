"""Inputs that used to pass the checks and fail after the workers started (or after training): each is refused
before any process starts, naming the key, the value and what is valid (issue 11, item 8); a finished run always
leaves a checkpoint (item 7b)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from recipe_helpers import tiny_recipe, tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import Recipe, RecipeError, from_dict, load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

BAD = [
    ("train", {"lr": float("nan")}, "train.lr = nan"),
    ("train", {"lr": float("inf")}, "train.lr = inf"),
    ("train", {"lr": 0.0}, "train.lr = 0.0"),
    ("train", {"beta1": 1.0}, "train.beta1 = 1.0 is invalid; valid: 0 <= value < 1"),
    ("train", {"beta2": -0.1}, "train.beta2 = -0.1"),
    ("train", {"eps": 0.0}, "train.eps = 0.0"),
    ("train", {"grad_clip": float("nan")}, "train.grad_clip = nan"),
    ("train", {"grad_clip": -1.0}, "train.grad_clip = -1.0"),
    ("parallel", {"timeout_s": float("inf")}, "parallel.timeout_s = inf"),
    ("parallel", {"timeout_s": 1e9}, "parallel.timeout_s = 1000000000.0 is invalid; valid: 0 < value <= 604800"),
    ("data", {"source": "stdlib", "vocab_size": 100}, "data.vocab_size = 100 is too small"),
    ("data", {"source": "stdlib", "vocab_size": 300, "max_bytes": 100}, "data.max_bytes = 100 cannot make one global batch"),
    ("sample", {"top_k": -1}, "sample.top_k = -1"),  # (an empty prompt is valid: it starts after an eod)
    ("sample", {"temperature": -0.5}, "sample.temperature = -0.5"),
]


@pytest.mark.parametrize("section, values, message", BAD, ids=[m.split(" ")[0] + str(i) for i, (_, _, m) in
                                                                enumerate(BAD)])
def test_bad_values_are_refused_naming_the_key(section, values, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        resolve(tiny_recipe(**{section: values}))


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "taken").write_text("x")
    with pytest.raises(RecipeError, match="is an existing file, not a folder"):
        resolve(tiny_recipe(run={"dir": str(tmp_path / "taken")}))


def test_empty_and_non_utf8_recipe_files_are_refused(tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing here\n")
    with pytest.raises(RecipeError, match="is empty"):
        load_recipe(empty)
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[sample]\nprompt = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(RecipeError, match="is not UTF-8 text"):
        load_recipe(latin)


@pytest.mark.parametrize("text, message", [
    ("[train]\nsteps = 3\nlr = 1e-3\nsteps = 4\n", "train.steps is set twice (lines 2 and 4)"),
    ("[train]\nsteps = 3\n[model]\npreset = 'gpt2-tiny'\n[train]\nlr = 1.0\n", "[train] is defined twice (lines 1 and 5)"),
    ("title = 'a'\ntitle = 'b'\n", "title is set twice (lines 1 and 2)"),
])
def test_a_key_or_table_defined_twice_is_named(tmp_path, text, message):
    path = tmp_path / "twice.toml"
    path.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert message in str(err.value) and str(path) in str(err.value)
    path.write_text("[train]\nsteps = = 3\n")  # other broken TOML keeps tomllib's own words
    with pytest.raises(RecipeError, match="is not valid TOML"):
        load_recipe(path)


def test_cli_refuses_before_any_process_starts(tmp_path):
    recipe = tmp_path / "bad.toml"
    recipe.write_text('[train]\nlr = nan\n[data]\nsource = "synthetic"\n'
                      f'[run]\ndir = "{tmp_path / "run"}"\n')
    out = subprocess.run([sys.executable, "-m", "megazoo.recipes.cli", "train", str(recipe)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "train.lr = nan" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_a_finished_run_always_leaves_a_checkpoint(tmp_path):
    res = tiny_resolved(train={"steps": 3}, run={"dir": str(tmp_path)}, checkpoint={"at_end": True})
    assert res.recipe.checkpoint.every == 0
    result = Trainer(res, Topology.solo()).fit()
    assert result.checkpoint == tmp_path / "checkpoints" / "step_00000003"
    assert (result.checkpoint / "manifest.json").is_file()


def test_the_default_is_to_save_at_the_end():
    assert from_dict(Recipe, {}).checkpoint.at_end is True
