"""Issue 15 item 2: `checkpoint.load` is checked against the recipe's model before any process starts, every
architecture mismatch in one message, and `model.from_checkpoint = true` takes the checkpoint's architecture
(the run's banner then names the checkpoint's model)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from recipe_helpers import tiny_resolved

from megazoo.models.config import ModelConfig
from megazoo.parallel.checkpoint.consolidate import write_full_checkpoint
from megazoo.recipes.cli import main as cli_main
from megazoo.recipes.config import RecipeError

CONVERTED = ModelConfig("tiny-converted", n_layer=2, n_head=2, d_model=32, n_positions=64, vocab_size=300,
                        dropout=0.0, attn_dropout=0.0)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A one-rank checkpoint of another shape than the recipe's, as `megazoo convert hf-to-megazoo` writes."""
    from megazoo.models.transformer import GPT
    from megazoo.parallel.topology import Topology

    out = tmp_path_factory.mktemp("converted") / "ckpt"
    model = GPT(CONVERTED, Topology.solo(torch.device("cpu")), device="meta")
    generator = torch.Generator().manual_seed(0)
    state = {name: 0.02 * torch.randn(p.shape, generator=generator) for name, p in model.state_dict().items()}
    state["wte.weight"] = state["wte.weight"][:CONVERTED.vocab_size]  # true vocabulary, as convert writes it
    write_full_checkpoint(state, dataclasses.asdict(CONVERTED), out)
    return out


def test_every_mismatch_is_listed_at_once(converted, tmp_path):
    with pytest.raises(RecipeError) as err:
        tiny_resolved(checkpoint={"load": str(converted)}, run={"dir": str(tmp_path / "r")})
    message = str(err.value)
    for expected in ("model.n_head = 2 there, 4 here", "model.d_model = 32 there, 128 here",
                     "model.d_ff = 128 there, 512 here", "model.n_positions = 64 there, 256 here",
                     "model.from_checkpoint = true"):
        assert expected in message, message


def test_from_checkpoint_takes_the_architecture(converted, tmp_path):
    res = tiny_resolved(model={"from_checkpoint": True, "dropout": 0.05}, checkpoint={"load": str(converted)},
                        run={"dir": str(tmp_path / "r")})
    assert dataclasses.replace(res.model, dropout=0.0) == CONVERTED
    assert res.model.dropout == 0.05  # non-architecture overrides still apply
    with pytest.raises(RecipeError, match=r"model.n_layer = 3 here, 2 in the checkpoint: remove these keys"):
        tiny_resolved(model={"from_checkpoint": True, "n_layer": 3}, checkpoint={"load": str(converted)})
    with pytest.raises(RecipeError, match="model.from_checkpoint = true needs checkpoint.load"):
        tiny_resolved(model={"from_checkpoint": True})


def test_train_cli_refuses_before_start_and_fine_tunes_with_from_checkpoint(converted, tmp_path, capsys):
    recipe = tmp_path / "ft.toml"
    recipe.write_text(f"""
[model]
preset = "gpt2-117m"
[train]
steps = 2
micro_batch = 2
seq_len = 32
precision = "fp32"
[data]
source = "synthetic"
synthetic_tokens = 4000
[checkpoint]
load = "{converted}"
load_optimizer = false
at_end = false
[run]
dir = "{tmp_path / 'run'}"
[logging]
progress = false
[sample]
tokens = 0
""", encoding="utf-8")
    assert cli_main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "model.n_layer = 2 there, 12 here" in err and "model.d_model = 32 there, 768 here" in err
    assert not (tmp_path / "run").exists()  # refused before anything started
    assert cli_main(["train", str(recipe), "--set", "model.from_checkpoint=true"]) == 0
    out = capsys.readouterr().out
    assert "megazoo: tiny-converted (from checkpoint.load, 2 layers, d_model 32, 2 heads, vocab 300" in out
    assert "weights only" in out
