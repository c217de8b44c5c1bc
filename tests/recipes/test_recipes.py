"""Every recipe in recipes/ parses, resolves and fits its topology at its real size; bad input fails early."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_helpers import TINY, tiny_recipe
from recipe_stand_ins import stand_in_overrides

from megazoo.recipes.config import Recipe, RecipeError, from_dict, load_recipe, parse_override
from megazoo.recipes.resolve import resolve

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.toml"))


def test_recipes_exist():
    assert any(p.name == "demo.toml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_resolves_at_its_real_size(path, tmp_path):
    recipe = load_recipe(path, stand_in_overrides(path, tmp_path))
    par = recipe.parallel
    res = resolve(recipe, world_size=par.dp * par.tp * par.pp * par.cp)
    cfg = res.model
    assert cfg.n_head % par.tp == 0 and res.padded_vocab % (128 * par.tp) == 0
    assert res.padded_vocab >= cfg.vocab_size and par.pp <= cfg.n_layer
    assert res.global_batch == recipe.train.micro_batch * recipe.train.grad_accum * par.dp
    assert recipe.train.seq_len <= cfg.n_positions


def test_demo_recipes_are_gpt2_tiny_at_dp2_zero2_and_tp2():
    folder = Path(__file__).resolve().parents[2] / "recipes"
    demo, tp2 = load_recipe(folder / "demo.toml"), load_recipe(folder / "demo_tp2.toml")
    assert (demo.model.preset, demo.parallel.dp, demo.parallel.tp, demo.zero.stage) == ("gpt2-tiny", 2, 1, 2)
    assert (tp2.model.preset, tp2.parallel.dp, tp2.parallel.tp, tp2.zero.stage) == ("gpt2-tiny", 1, 2, 0)
    assert resolve(demo).global_batch == resolve(tp2).global_batch == 16


def test_overrides_are_typed_and_applied(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('[train]\nsteps = 5\n[run]\ndir = "x"\n')
    recipe = load_recipe(path, ["train.lr=3e-4", "run.dir=runs/other", "train.activation_checkpointing=true"])
    assert recipe.train.lr == 3e-4 and recipe.train.steps == 5
    assert recipe.run.dir == "runs/other" and recipe.train.activation_checkpointing is True
    assert parse_override("parallel.tp=2") == (["parallel", "tp"], 2)


def _error(fn) -> str:
    with pytest.raises(RecipeError) as info:
        fn()
    return str(info.value)


def test_unknown_key_is_rejected_at_every_level(tmp_path):
    msg = _error(lambda: tiny_recipe(train={"stepz": 3}))
    assert "train.stepz" in msg and "steps" in msg  # names the key and the valid ones
    msg = _error(lambda: from_dict(Recipe, {**TINY, "trian": {}}))
    assert "trian" in msg and "train" in msg
    path = tmp_path / "r.toml"
    path.write_text("[model]\npreset = 'gpt2-tiny'\n")
    assert "model.presett" in _error(lambda: load_recipe(path, ["model.presett=gpt2-117m"]))


def test_wrong_type_is_rejected():
    msg = _error(lambda: tiny_recipe(train={"steps": "ten"}))
    assert "train.steps" in msg and "int" in msg


def test_tp_must_divide_heads():
    recipe = tiny_recipe(model={"preset": "tnlg-17b", "vocab_size": None}, parallel={"tp": 8})
    msg = _error(lambda: resolve(recipe))
    assert "parallel.tp = 8" in msg and "n_head = 28" in msg and "1, 2, 4, 7, 14, 28" in msg


def test_world_size_must_match_layout():
    msg = _error(lambda: resolve(tiny_recipe(parallel={"dp": 2, "tp": 2}), world_size=2))
    assert "dp=2 x tp=2 x pp=1 = 4" in msg and "--nproc 4" in msg


def test_explicit_global_batch_must_add_up():
    msg = _error(lambda: resolve(tiny_recipe(parallel={"dp": 2}, train={"global_batch": 10})))
    assert "train.global_batch = 10" in msg and "4 x 1 x 2 = 8" in msg
    assert resolve(tiny_recipe(parallel={"dp": 2}, train={"global_batch": 8})).global_batch == 8


@pytest.mark.parametrize("section, values, fragment", [
    ("parallel", {"pp": 3}, "parallel.pp = 3"),  # larger than the 2 blocks of the test model
    ("train", {"seq_len": 4096}, "train.seq_len = 4096"),
    ("train", {"precision": "fp8"}, "train.precision = 'fp8'"),
    ("data", {"source": "web"}, "data.source = 'web'"),
    ("model", {"preset": "gpt5"}, "gpt2-117m"),
    ("train", {"lr": 0.0}, "train.lr"),
])
def test_bad_values_name_the_field(section, values, fragment):
    assert fragment in _error(lambda: resolve(tiny_recipe(**{section: values})))


def test_model_section_overrides_every_model_field():
    import dataclasses

    from megazoo.models.config import model_fields
    from megazoo.recipes.config import ModelSection
    fields = {f.name: f.default for f in dataclasses.fields(ModelSection)}
    assert fields.pop("preset") == "gpt2-tiny"
    assert fields.pop("from_checkpoint") is False  # the two keys that are not ModelConfig overrides
    assert fields.pop("from_hf") == ""
    assert set(fields) == set(model_fields()) - {"name"} and set(fields.values()) == {None}
    assert "d_ff" in _error(lambda: tiny_recipe(model={"d_fff": 64}))  # unknown keys still list the valid ones
    assert "model.d_ff" in _error(lambda: tiny_recipe(model={"d_ff": "wide"}))  # and types are still checked


def test_d_ff_override_reaches_the_model(tmp_path):
    cfg = resolve(tiny_recipe(model={"d_ff": 200})).model
    assert cfg.d_ff == 200 and cfg.n_layer == 2  # the other overrides of the recipe still apply
    assert resolve(tiny_recipe()).model.d_ff == 4 * cfg.d_model  # unset: the preset's (4 x d_model)
    assert resolve(tiny_recipe(model={"d_model": 64})).model.d_ff == 256  # follows an overridden d_model
    path = tmp_path / "r.toml"
    path.write_text("[model]\npreset = 'gpt2-tiny'\n")
    recipe = load_recipe(path, ["model.d_ff=384", "model.layer_norm_eps=1e-6"])
    cfg = resolve(recipe).model
    assert (cfg.d_ff, cfg.layer_norm_eps) == (384, 1e-6)
    msg = _error(lambda: resolve(tiny_recipe(model={"d_ff": 6}, parallel={"tp": 4})))
    assert "parallel.tp = 4" in msg and "d_ff = 6" in msg and "valid tp: 1, 2" in msg
