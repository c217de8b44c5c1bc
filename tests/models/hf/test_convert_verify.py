"""`megazoo convert ... --verify` (issue 32): a conversion is published only once a fixed sample scores the same
through megazoo and through transformers (fp64); a deliberately broken conversion exits 1 and writes nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from megazoo.models.hf import gpt2 as hf
from megazoo.recipes import cli


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=1000,
                                       initializer_range=0.1, bos_token_id=999, eos_token_id=999))
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(str(path))
    return path


def test_verified_round_trip_passes(hf_dir, tmp_path, capsys):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(ckpt), "--verify"]) == 0
    assert cli.main(["convert", "megazoo-to-hf", str(ckpt), "--out", str(back), "--verify",
                     "--tokenizer", "none"]) == 0
    out = capsys.readouterr().out
    assert out.count("logits (max abs difference)") == 2 and "FAIL" not in out
    assert (back / "model.safetensors").is_file()


def _skip_transpose_of(layer: str):
    """A broken conversion: one square Conv1D weight is copied without its transpose (shapes still match)."""
    real = hf._is_conv1d_weight
    return lambda name: real(name) and f".{layer}." not in f".{name}"


@pytest.mark.parametrize("direction", ["megazoo-to-hf", "hf-to-megazoo"])
def test_broken_conversion_is_refused_and_nothing_written(hf_dir, tmp_path, capsys, monkeypatch, direction):
    ckpt = tmp_path / "ckpt"
    if direction == "megazoo-to-hf":
        assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(ckpt)]) == 0
    monkeypatch.setattr(hf, "_is_conv1d_weight", _skip_transpose_of("attn.c_proj"))
    out_dir = tmp_path / "out"
    source = str(ckpt) if direction == "megazoo-to-hf" else str(hf_dir)
    extra = ["--tokenizer", "none"] if direction == "megazoo-to-hf" else []
    assert cli.main(["convert", direction, source, "--out", str(out_dir), "--verify", *extra]) == 1
    captured = capsys.readouterr()
    assert "logits (max abs difference)" in captured.out and "FAIL" in captured.out
    assert "refused, nothing written to --out" in captured.err
    assert not out_dir.exists() and not list(tmp_path.glob(".out.tmp-*"))
