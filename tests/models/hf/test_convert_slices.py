"""`megazoo convert ... --verify` scores a WikiText slice and a LAMBADA slice through megazoo and transformers
(issue 32): a correct conversion agrees to fp64 rounding both ways; a conversion that breaks only what the fixed
sample cannot see (positions past its 64 tokens) is caught by the slices, exits 1 and writes nothing; no data
found is said in one line and the fixed sample alone is scored."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from megazoo.models.hf import convert_slices
from megazoo.models.hf import gpt2 as hf
from megazoo.recipes import cli

SMALL = ["--verify-tokens", "300", "--verify-lambada", "4"]  # 3 windows of 128 tokens, 4 passages


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=128, vocab_size=50257,
                                       initializer_range=0.2))
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2-bpe"
    model.save_pretrained(str(path))
    return path


def _zero_late_positions(entries):
    """A broken key map (models/hf/families.py): the position table's rows past 64 come out zero (shapes
    unchanged), both ways; the fixed sample (64 tokens) never reads them, the 128-token WikiText windows and
    LAMBADA passages do."""
    def zeroed(tensor):
        tensor = tensor.clone()
        tensor[64:] = 0
        return tensor

    def broken(cfg):
        return [dataclasses.replace(e, join_fn=lambda ts: zeroed(ts[0]), split_fn=lambda t: [zeroed(t)])
                if e.ours == "wpe.weight" else e for e in entries(cfg)]
    return broken


def test_slices_agree_both_ways(hf_dir, tmp_path, capsys, data_dir):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    common = ["--verify", "--verify-data", str(data_dir), *SMALL]
    assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(ckpt), *common]) == 0
    assert cli.main(["convert", "megazoo-to-hf", str(ckpt), "--out", str(back), "--tokenizer", "none", *common]) == 0
    out = capsys.readouterr().out
    assert out.count("WikiText ppl (299 tokens, rel)") == 2 and out.count("LAMBADA accuracy (4 items") == 2
    assert "FAIL" not in out and (back / "model.safetensors").is_file()


@pytest.mark.parametrize("direction", ["hf-to-megazoo", "megazoo-to-hf"])
def test_conversion_broken_past_the_sample_is_caught_by_the_slices(hf_dir, tmp_path, capsys, monkeypatch, data_dir,
                                                                   direction):
    ckpt, out_dir = tmp_path / "ckpt", tmp_path / "out"
    if direction == "megazoo-to-hf":
        assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(ckpt)]) == 0
    monkeypatch.setattr(hf, "FAMILY", dataclasses.replace(hf.FAMILY, entries=_zero_late_positions(hf.entries)))
    source = [str(hf_dir)] if direction == "hf-to-megazoo" else [str(ckpt), "--tokenizer", "none"]
    code = cli.main(["convert", direction, *source, "--out", str(out_dir), "--verify", "--verify-data", str(data_dir),
                     *SMALL])
    captured = capsys.readouterr()
    assert code == 1, captured.out + captured.err
    sample = next(line for line in captured.out.splitlines() if "logits (max abs difference)" in line)
    assert sample.endswith("pass")  # the fixed sample cannot see it ...
    wikitext = next(line for line in captured.out.splitlines() if "WikiText ppl" in line)
    assert wikitext.endswith("FAIL")  # ... the slice does
    assert "refused, nothing written to --out" in captured.err
    assert not out_dir.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_no_data_found_says_so_and_scores_the_sample(hf_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGAZOO_DATA_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(tmp_path / "ckpt"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verify: no WikiText / LAMBADA data in" in out and "scoring the fixed sample only" in out
    assert "logits (max abs difference)" in out and "WikiText ppl" not in out


def test_verify_data_without_the_data_is_refused_before_converting(hf_dir, tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(out_dir), "--verify",
                     "--verify-data", str(tmp_path)]) == 2
    assert "--verify-data" in capsys.readouterr().err and not out_dir.exists()


def test_slice_scores_match_a_direct_computation(data_dir):
    """The slice scorer's perplexity equals exp(mean NLL) computed by hand over the same windows."""
    data = convert_slices.load_slices(data_dir, 40, 2)
    assert len(data.wikitext) == 40 and len(data.lambada) == 2
    table = torch.randn(50257, 50257 // 4097 + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fn = lambda ids: table[ids] @ table.T  # noqa: E731  a deterministic stand-in model: logits of bigram features
    score = convert_slices.score_slices(fn, data, n_positions=16)  # windows of 16: 0-16, 16-32, 32-39
    ids = torch.tensor(data.wikitext)
    nll = torch.nn.functional.cross_entropy(fn(ids[None, :-1])[0], ids[1:])  # a bigram model: windows do not matter
    assert score.wikitext_scored == 39
    assert score.wikitext_ppl == pytest.approx(torch.exp(nll).item(), rel=1e-12)
