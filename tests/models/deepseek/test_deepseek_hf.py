"""HF DeepseekV3ForCausalLM <-> megazoo (models/deepseek/hf.py and mla.py): from tiny random configs
(deepseek_hf_helpers: MLA with and without q compression, group-limited sigmoid routing with a random routing
bias, YaRN, first-k-dense, shared experts) our logits equal transformers' to 1e-5 in fp32 at tp 1, tp 2 (plain and
sequence parallel) and ep 2 (gloo); `megazoo convert` both ways with --verify gives back transformers' own files."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from cli_helpers import megazoo
from deepseek_hf_helpers import IDS, hf_dir, hf_logits, hf_model, logits_at, megazoo_logits
from hf_helpers import safetensors_state, tiny_hf_tokenizer

from megazoo.models.deepseek import hf as deepseek
from megazoo.models.hf.families import family_of_config, read_hf_dir
from megazoo.models.hf.safetensors_files import HFWeights
from megazoo.parallel.topology import Topology

KINDS = ("qlora", "plain_q")


@pytest.mark.parametrize("kind", KINDS)
def test_config_both_ways_and_counts(kind):
    cfg, full = read_hf_dir(hf_dir(kind))
    assert family_of_config(cfg) is deepseek.FAMILY and cfg.mla and cfg.moe_router == "sigmoid_bias"
    assert (cfg.q_lora_rank, cfg.rope_scaling) == ((16, "none") if kind == "qlora" else (0, "yarn"))
    assert deepseek.config_from_hf(deepseek.config_to_hf(cfg), name=cfg.name) == cfg
    assert cfg.num_parameters() == sum(p.numel() for p in hf_model(kind).parameters())
    assert full["h.1.mlp.router.expert_bias"].abs().sum() > 0  # the routing bias is read


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2-sp", "ep2"])
def test_logits_equal_transformers(kind, layout):
    cfg, full = read_hf_dir(hf_dir(kind))
    for logits in logits_at(layout, cfg, full):
        deviation = (logits - hf_logits(kind)).abs().max().item()
        assert deviation < 1e-5, f"{kind} {layout}: max |logit difference| {deviation:.2e}"


def test_rope_permutation_is_needed():
    """Without the interleaved-rotary row permutation (identity join) the logits differ: the map's permutation
    is what makes DeepSeek's interleaved pairs our halves."""
    cfg, full = read_hf_dir(hf_dir("qlora"))
    raw, weights = dict(full), HFWeights(hf_dir("qlora"))
    for entry in deepseek.entries(cfg):
        if entry.ours.endswith(("q_b.weight", "kv_a.weight")):
            raw[entry.ours] = torch.cat([weights.read(n) for n in entry.hf])
    deviation = (megazoo_logits(Topology.solo(), cfg, raw) - hf_logits("qlora")).abs().max().item()
    assert deviation > 1e-3, deviation




@pytest.mark.parametrize("kind", KINDS)
def test_convert_both_ways_verified(kind, tmp_path, capsys):
    hf, ckpt, back = hf_dir(kind), tmp_path / "ckpt", tmp_path / "back"
    tiny_hf_tokenizer().save_pretrained(str(hf))
    assert megazoo(["convert", "hf-to-megazoo", hf, "--out", ckpt, "--verify"]) == 0
    assert megazoo(["convert", "megazoo-to-hf", ckpt, "--out", back, "--verify"]) == 0
    out = capsys.readouterr().out
    assert out.count("logits (max abs difference)") == 2 and "FAIL" not in out, out
    assert json.loads((back / "config.json").read_text())["model_type"] == "deepseek_v3"
    theirs, ours = safetensors_state(hf), safetensors_state(back)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    with torch.no_grad():
        assert (loaded(IDS).logits - hf_logits(kind)).abs().max().item() < 1e-5
