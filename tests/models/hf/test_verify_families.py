"""`megazoo convert --verify` for every family (issue 37): a correct conversion of a tiny random Llama (llama3 rope
scaling, untied), Qwen2 (q/k/v bias, tied, rope theta 1e6) and Mistral (sliding window) passes both ways, and a
mistake planted in the family's key map or config (a transposed projection, two query heads swapped, a rope
theta off by 10x, Llama 3.1's scaling dropped or one added) is refused in either direction with nothing
written. The tolerance is the model's own fp32 floor x 2 (models/hf/convert_verify.py says why), and stays far
below what a mistake moves."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hf_helpers import DENSE_FAMILIES, tiny_family_model

from megazoo.models.hf import llama
from megazoo.recipes import cli

@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def hf_dir(request, tmp_path_factory):
    model = tiny_family_model(request.param, vocab=512, positions=128)
    path = tmp_path_factory.mktemp("hf") / request.param
    model.save_pretrained(str(path))
    return path


def _tolerance(out: str) -> float:
    line = next(line for line in out.splitlines() if "logits (max abs difference)" in line)
    return float(re.split(r"\s+", line.strip())[-2])


def test_correct_conversion_passes_both_ways(hf_dir, tmp_path, capsys):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(ckpt), "--verify"]) == 0
    assert cli.main(["convert", "megazoo-to-hf", str(ckpt), "--out", str(back), "--verify", "--tokenizer",
                     "none"]) == 0
    out = capsys.readouterr().out
    assert out.count("logits (max abs difference)") == 2 and "FAIL" not in out
    assert "2 x this model's fp32-vs-fp64 deviation" in out
    assert 1e-10 < _tolerance(out) < 1e-5  # the fp32 floor: ~1e-7 here, 1e3-1e6 x below a mistake's effect


def _swap_heads(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    w = w.clone()
    w[:head_dim], w[head_dim:2 * head_dim] = w[head_dim:2 * head_dim].clone(), w[:head_dim].clone()
    return w


def _planted(mistake: str, direction: str):
    """The Llama families' key map with one mistake, on the side `direction` runs through."""
    family = llama.FAMILY
    if mistake in ("theta", "scaling"):
        def wrong(cfg):
            if mistake == "theta":
                return dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 10)
            if cfg.rope_scaling == "llama3":  # Llama 3.1's scaling dropped, or one added where there is none
                return dataclasses.replace(cfg, rope_scaling="none")
            return dataclasses.replace(cfg, rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                                       rope_high_freq_factor=4.0, rope_original_positions=16)
        if direction == "hf-to-megazoo":
            return dataclasses.replace(family, config_from_hf=lambda c, name=None: wrong(llama.config_from_hf(c, name)))
        return dataclasses.replace(family, config_to_hf=lambda cfg, special=None: llama.config_to_hf(wrong(cfg),
                                                                                                      special))
    target, change = {"transposed": ("h.1.attn.c_proj.weight", lambda t, cfg: t.t().contiguous()),
                      "swapped-q-heads": ("h.0.attn.c_q.weight", lambda t, cfg: _swap_heads(t, cfg.head_dim))}[mistake]

    def entries(cfg):
        out = []
        for e in llama.entries(cfg):
            if e.ours == target and direction == "hf-to-megazoo":
                e = dataclasses.replace(e, join_fn=lambda ts, cfg=cfg: change(ts[0], cfg))
            elif e.ours == target:
                e = dataclasses.replace(e, split_fn=lambda t, cfg=cfg: [change(t, cfg)])
            out.append(e)
        return out
    return dataclasses.replace(family, entries=entries)


@pytest.mark.parametrize("direction", ["hf-to-megazoo", "megazoo-to-hf"])
@pytest.mark.parametrize("mistake", ["transposed", "swapped-q-heads", "theta", "scaling"])
def test_planted_mistake_is_refused(hf_dir, tmp_path, capsys, monkeypatch, mistake, direction):
    ckpt, out_dir = tmp_path / "ckpt", tmp_path / "out"
    if direction == "megazoo-to-hf":
        assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(ckpt)]) == 0
    monkeypatch.setattr(llama, "FAMILY", _planted(mistake, direction))
    source = [str(hf_dir)] if direction == "hf-to-megazoo" else [str(ckpt), "--tokenizer", "none"]
    assert cli.main(["convert", direction, *source, "--out", str(out_dir), "--verify"]) == 1
    captured = capsys.readouterr()
    line = next(line for line in captured.out.splitlines() if "logits (max abs difference)" in line)
    deviation, tolerance = (float(x) for x in re.split(r"\s+", line.strip())[-3:-1])
    assert line.endswith("FAIL") and deviation > 100 * tolerance, line
    assert "refused, nothing written to --out" in captured.err
    assert not out_dir.exists() and not list(tmp_path.glob(".out.tmp-*"))
