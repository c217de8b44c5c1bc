"""Every recipe in recipes/ parses, resolves and fits its topology at its real size; bad input fails early."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from recipe_helpers import TINY, tiny_recipe

from megazoo.data.indexed_dataset import IndexedDatasetWriter
from megazoo.recipes.config import Recipe, RecipeError, from_dict, load_recipe, parse_override
from megazoo.recipes.resolve import model_config, resolve

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.toml"))


def test_recipes_exist():
    assert any(p.name == "demo.toml" for p in RECIPES)


def stand_in_gpt2_bpe(folder: Path) -> Path:
    """A GPT-2 BPE folder with GPT-2's vocabulary size (50,257 ids, `<|endoftext|>` = 50256) and one merge: the
    recipe checks read only the tokenizer's size, so the shipped recipes resolve without the real files, from a
    checkout anywhere (the real files' own tests: tests/test_eval_data.py, test_data_catalog.py)."""
    from tokenizers import pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ab"]  # every byte, so any text encodes
    symbols += [f"<stand-in {i}>" for i in range(50256 - len(symbols))] + ["<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(symbols)}))
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    return folder


def _stand_ins(path: Path, tmp_path: Path) -> list[str]:
    """Overrides pointing a recipe's user files (corpus, tokenizer, checkpoint to start from) at small stand-ins,
    so the recipe itself is checked at its real size without the user's data, wherever the checkout lives."""
    table = load_recipe(path)
    overrides = []
    if table.data.source == "indexed":  # a small valid corpus: the resolver checks magic, sizes and checksums
        with IndexedDatasetWriter(tmp_path / "corpus", 50257) as writer:
            for doc in range(4):
                writer.add_document(np.arange(doc, doc + 100) % 50257)
        overrides += [f'data.paths=["{tmp_path / "corpus"}"]', "data.valid_paths=[]"]
    if table.data.tokenizer and not Path(table.data.tokenizer).exists():  # "gpt2-bpe", a data catalog name
        overrides.append(f"data.tokenizer={stand_in_gpt2_bpe(tmp_path / 'gpt2_bpe')}")
    if table.sft.path:  # a few SFT rows (tokens + loss mask): `megazoo data sft-demo` builds the real ones
        from megazoo.data.sft_dataset import write_sft_dataset
        from megazoo.data.sft_examples import SFTExamples

        rows = SFTExamples(ids=[list(range(1, 20)), list(range(5, 15))], masks=[[0] * 12 + [1] * 7, [0] * 6 + [1] * 4],
                           rows=2)
        write_sft_dataset(rows, tmp_path / "sft", 300, template="chatml", seq_len=table.train.seq_len)
        overrides.append(f"sft.path={tmp_path / 'sft'}")
    if table.checkpoint.load:  # a stand-in step directory: the resolver reads only its common.json's model
        step = tmp_path / "checkpoint" / "step_00000000"
        step.mkdir(parents=True)
        cfg = model_config(load_recipe(path, [*overrides, "model.from_checkpoint=false"]))
        (step / "common.json").write_text(json.dumps({"step": 0, "model": dataclasses.asdict(cfg)}))
        overrides.append(f"checkpoint.load={step.parent}")
    return overrides


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_resolves_at_its_real_size(path, tmp_path):
    recipe = load_recipe(path, _stand_ins(path, tmp_path))
    par = recipe.parallel
    res = resolve(recipe, world_size=par.dp * par.tp * par.pp * par.cp)
    cfg = res.model
    assert cfg.n_head % par.tp == 0 and res.padded_vocab % (128 * par.tp) == 0
    assert res.padded_vocab >= cfg.vocab_size and par.pp <= cfg.n_layer
    assert res.global_batch == recipe.train.micro_batch * recipe.train.grad_accum * par.dp
    assert recipe.train.seq_len <= cfg.n_positions


def test_demo_recipes_are_gpt2_tiny_at_dp2_zero2_and_tp2():
    folder = Path(__file__).resolve().parents[1] / "recipes"
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
    assert fields.pop("from_checkpoint") is False  # the one key that is not a ModelConfig override
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
