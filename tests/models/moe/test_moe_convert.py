"""`megazoo convert` for the MoE / Qwen3 families through the one registry (models/hf/families.py ->
models/hf/moe_families.py's FAMILY and key map): tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and Qwen3 folders
(transformers' own classes, saved locally with a tokenizer) convert hf-to-megazoo and back with --verify passing
(its fp64 transformers side runs the experts' per-expert loop: the grouped matmul refuses fp64 on CPU), the
checkpoint records the MoE fields, the tokenizer travels both ways, the folder written loads in transformers with
its logits equal to the original's (1e-5, fp32) and its tensors equal, the streaming writer's shards split it
across several files, and two experts swapped in the key map fail --verify in either direction with nothing
written. `eval --hf` reads a Qwen3-MoE folder as its converted checkpoint scores."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import pytest
import torch
import transformers
from hf_helpers import FAMILY_VOCAB as V, MOE_FAMILIES as FAMILIES, safetensors_state, tiny_family_model
from hf_helpers import tiny_hf_tokenizer

from cli_helpers import megazoo
from megazoo.models.hf import moe_families

IDS = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(5))


@functools.lru_cache(maxsize=None)
def _model(family: str):
    return tiny_family_model(family, noise=0.3, width=32)


def _save(family: str, path):
    _model(family).save_pretrained(str(path))
    return path


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                             experts_implementation="eager").eval()




@pytest.mark.parametrize("family", FAMILIES)
def test_convert_both_ways_verified_sharded_and_loadable(family, tmp_path, capsys):
    hf, ckpt, back = _save(family, tmp_path / "hf"), tmp_path / "ckpt", tmp_path / "back"
    tiny_hf_tokenizer().save_pretrained(str(hf))
    assert megazoo(["convert", "hf-to-megazoo", hf, "--out", ckpt, "--verify"]) == 0
    (common,) = ckpt.rglob("common.json")
    recorded = json.loads(common.read_text())["model"]
    assert recorded["n_experts"] == (0 if family == "qwen3" else 4) and recorded["qk_norm"] == family.startswith("qwen3")
    assert megazoo(["convert", "megazoo-to-hf", ckpt, "--out", back, "--verify", "--max-shard-size", "40KB"]) == 0
    out = capsys.readouterr().out
    assert out.count("logits (max abs difference)") == 2 and "FAIL" not in out, out
    assert f"converted HF {family}" in out and "with its tokenizer" in out
    assert (back / "tokenizer.json").is_file()
    assert json.loads((back / "config.json").read_text())["model_type"] == family
    assert len(list(back.glob("*.safetensors"))) > 2 and (back / "model.safetensors.index.json").is_file()
    theirs, ours = safetensors_state(hf), safetensors_state(back)
    if family == "qwen3":  # the tied head: save_pretrained leaves it out, as our writer does
        theirs.pop("lm_head.weight", None)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    if family != "qwen3":
        assert any(".experts.3." in name for name in ours)  # the files' per-expert form
    loaded = _load(back)
    assert type(loaded) is type(_model(family))
    with torch.no_grad():
        deviation = (loaded(IDS).logits - _model(family)(IDS).logits).abs().max().item()
    assert deviation < 1e-5, deviation


def _swapped_experts(direction: str):
    """The MoE family with experts 0 and 1 of layer 0's stacked c_fc swapped on the side `direction` runs."""
    family = moe_families.FAMILY
    swap = [1, 0, 2, 3]

    def entries(cfg):
        out = []
        for e in moe_families.entries(cfg):
            if e.ours == "h.0.mlp.experts.c_fc.weight" and direction == "hf-to-megazoo":
                e = dataclasses.replace(e, join_fn=lambda ts, e=e: e.join(ts)[swap])
            elif e.ours == "h.0.mlp.experts.c_fc.weight":
                e = dataclasses.replace(e, split_fn=lambda t, e=e: e.split(t[swap]))
            out.append(e)
        return out
    return dataclasses.replace(family, entries=entries)


@pytest.mark.parametrize("direction", ["hf-to-megazoo", "megazoo-to-hf"])
def test_swapped_experts_fail_verify(direction, tmp_path, capsys, monkeypatch):
    hf, ckpt, out_dir = _save("mixtral", tmp_path / "hf"), tmp_path / "ckpt", tmp_path / "out"
    if direction == "megazoo-to-hf":
        assert megazoo(["convert", "hf-to-megazoo", hf, "--out", ckpt]) == 0
    monkeypatch.setattr(moe_families, "FAMILY", _swapped_experts(direction))
    source = [hf] if direction == "hf-to-megazoo" else [ckpt, "--tokenizer", "none"]
    assert megazoo(["convert", direction, *source, "--out", out_dir, "--verify"]) == 1
    captured = capsys.readouterr()
    line = next(line for line in captured.out.splitlines() if "logits (max abs difference)" in line)
    deviation, tolerance = (float(x) for x in re.split(r"\s+", line.strip())[-3:-1])
    assert line.endswith("FAIL") and deviation > 100 * tolerance, line
    assert not out_dir.exists()


def test_eval_hf_reads_a_qwen3_moe_folder(tmp_path, data_dir):
    hf, ckpt = _save("qwen3_moe", tmp_path / "hf"), tmp_path / "ckpt"
    tiny_hf_tokenizer().save_pretrained(str(hf))
    assert megazoo(["convert", "hf-to-megazoo", hf, "--out", ckpt]) == 0
    data = data_dir / "lambada/lambada_test.jsonl"
    scores = []
    for source in (["--hf", hf], ["--checkpoint", ckpt]):
        out = tmp_path / f"{len(scores)}.json"
        assert megazoo(["eval", "lambada", *source, "--data", data, "--limit", 3, "--json", out]) == 0
        scores.append(json.loads(out.read_text()))
    key = "nll_sum" if "nll_sum" in scores[0] else "ppl"
    assert scores[0][key] > 0 and scores[0][key] == scores[1][key], scores
    assert scores[0]["num_examples"] == scores[1]["num_examples"] == 3
