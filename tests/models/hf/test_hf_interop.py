"""Hugging Face GPT-2 <-> megazoo: same logits after import (tp 1 and 2), after export, and through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from harness import run_distributed
from hf_helpers import VOCAB, tiny_hf_model
from transformers import GPT2LMHeadModel

from megazoo.eval.scoring import gpt_logits_fn
from megazoo.models.hf.convert_cli import load_consolidated, register, save_consolidated
from megazoo.parallel.checkpoint.io import CheckpointError
from megazoo.models.hf.gpt2 import (config_from_hf, config_to_hf, export_hf_dir, gpt_from_full_state, hf_to_megazoo_state,
                            import_hf_dir, megazoo_to_hf_state)
from megazoo.models.weights import full_state_dict
from megazoo.parallel.topology import Topology


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    tiny_hf_model().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


def hf_logits(path, ids):
    with torch.no_grad():
        return GPT2LMHeadModel.from_pretrained(str(path)).eval()(ids).logits


def test_state_round_trip_and_config():
    hf = tiny_hf_model(vocab=1000)
    cfg = config_from_hf(hf.config, name="t")
    assert (cfg.n_layer, cfg.n_head, cfg.d_model, cfg.d_ff, cfg.vocab_size) == (2, 4, 64, 256, 1000)
    full = hf_to_megazoo_state(hf.state_dict(), cfg)
    assert full["h.0.attn.c_attn.weight"].shape == (192, 64)  # Conv1D (in, out) -> Linear (out, in)
    assert "lm_head.weight" not in full
    back = megazoo_to_hf_state(full, cfg)
    for name, tensor in back.items():
        assert torch.equal(tensor, hf.state_dict()[name]), name
    assert config_from_hf(config_to_hf(cfg), name="t") == cfg


def test_unsupported_variants_are_refused():
    hf_config = tiny_hf_model(vocab=1000).config
    hf_config.activation_function = "relu"
    with pytest.raises(ValueError, match="activation_function"):
        config_from_hf(hf_config)
    cfg = config_from_hf(tiny_hf_model(vocab=1000).config)
    state = tiny_hf_model(vocab=1000).state_dict()
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match="missing"):
        hf_to_megazoo_state(state, cfg)


def test_import_tp1_matches_transformers(hf_dir, ids):
    model = import_hf_dir(hf_dir, Topology.solo())
    torch.testing.assert_close(gpt_logits_fn(model)(ids), hf_logits(hf_dir, ids), rtol=1e-5, atol=1e-5)


def _import_and_score(hf_dir, ids):
    model = import_hf_dir(hf_dir, Topology.build(dp=1, tp=2))
    assert model.wte.weight.shape[0] == model.cfg.padded_vocab(2) // 2  # really sharded
    return gpt_logits_fn(model)(ids), full_state_dict(model)


def test_import_tp2_matches_transformers(hf_dir, ids):
    expected = hf_logits(hf_dir, ids)
    reference_state = import_hf_dir(hf_dir, Topology.solo()).state_dict()
    for logits, full in run_distributed(_import_and_score, 2, hf_dir, ids):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        for name, tensor in full.items():  # gathering the shards gives back the imported weights
            ref = reference_state[name][: tensor.shape[0]] if name == "wte.weight" else reference_state[name]
            assert torch.equal(tensor, ref), name


def test_export_loads_in_transformers(hf_dir, ids, tmp_path):
    model = import_hf_dir(hf_dir, Topology.solo())
    out = export_hf_dir(full_state_dict(model), model.cfg, tmp_path / "exported")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(hf_dir, ids), rtol=1e-5, atol=1e-5)


def _cli(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="megazoo")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_convert_cli_round_trip_and_refusals(hf_dir, ids, tmp_path, capsys):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert _cli(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(ckpt)]) == 0
    manifest = json.loads((ckpt / "step_00000000" / "manifest.json").read_text())
    assert manifest["format"] == "megazoo-sharded-checkpoint/1" and (ckpt / "latest").read_text() == "step_00000000"
    cfg, full = load_consolidated(ckpt)
    assert cfg.n_layer == 2
    mz_logits = gpt_logits_fn(gpt_from_full_state(cfg, full, Topology.solo()))(ids)
    torch.testing.assert_close(mz_logits, hf_logits(hf_dir, ids), rtol=1e-5, atol=1e-5)
    assert _cli(["convert", "megazoo-to-hf", str(ckpt), "--out", str(back)]) == 0
    torch.testing.assert_close(hf_logits(back, ids), hf_logits(hf_dir, ids), rtol=1e-5, atol=1e-5)

    # A non-empty --out is refused and left untouched.
    shard = ckpt / "step_00000000" / "rank00000.pt"
    before = shard.read_bytes()
    assert _cli(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(ckpt)]) == 2
    assert "not empty" in capsys.readouterr().err and shard.read_bytes() == before
    # A directory that is not an HF checkpoint / not a megazoo checkpoint: one clear line naming it.
    assert _cli(["convert", "hf-to-megazoo", str(tmp_path / "nothing"), "--out", str(tmp_path / "o1")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert _cli(["convert", "megazoo-to-hf", str(hf_dir), "--out", str(tmp_path / "o2")]) == 2
    assert "not a megazoo checkpoint" in capsys.readouterr().err


def test_truncated_checkpoint_is_detected(tmp_path):
    hf = tiny_hf_model(vocab=1000)
    cfg = config_from_hf(hf.config, name="t")
    ckpt = save_consolidated(hf_to_megazoo_state(hf.state_dict(), cfg), cfg, tmp_path / "ckpt")
    weights = ckpt / "step_00000000" / "rank00000.pt"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"rank00000.pt is truncated"):
        load_consolidated(ckpt / "step_00000000")
    (ckpt / "step_00000000" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is corrupt"):
        load_consolidated(ckpt / "step_00000000")
