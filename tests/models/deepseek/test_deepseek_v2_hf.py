"""HF DeepseekV2ForCausalLM <-> megazoo (models/deepseek/hf.py's deepseek_v2 entry in VARIANTS, on the DeepSeek-V3
family's key map and decoder): from tiny random configs (deepseek_hf_helpers.v2_config: V2-Lite's greedy softmax
routing without q compression under YaRN, and V2's group_limited_greedy with q compression and a routed scale) our
logits equal transformers' to 1e-5 in fp32 at tp 1, tp 2 and ep 2 (gloo); `megazoo convert` both ways with --verify
gives back transformers' own files; the deepseek-v2-lite preset is written as a DeepseekV2Config whose model, on the
meta device, has the preset's exact parameter count."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from cli_helpers import megazoo
from deepseek_hf_helpers import IDS, hf_dir, hf_logits, hf_model, logits_at, megazoo_logits
from hf_helpers import safetensors_state

from megazoo.models.presets import get_preset
from megazoo.models.deepseek import hf as deepseek
from megazoo.models.hf.families import family_of_config, read_hf_dir
from megazoo.parallel.topology import Topology

KINDS = ("v2_lite", "v2_grouped")


@pytest.mark.parametrize("kind", KINDS)
def test_config_both_ways_and_counts(kind):
    cfg, full = read_hf_dir(hf_dir(kind))
    assert family_of_config(cfg) is deepseek.FAMILY and deepseek.exports(cfg) == "deepseek_v2"
    lite = kind == "v2_lite"
    assert (cfg.moe_router, cfg.moe_norm_topk_prob, cfg.moe_n_group, cfg.moe_topk_group,
            cfg.moe_routed_scaling_factor, cfg.q_lora_rank, cfg.rope_scaling, cfg.mtp_depth) == (
        ("softmax", False, 1, 1, 1.0, 0, "yarn", 0) if lite else ("softmax", False, 4, 2, 2.5, 16, "none", 0))
    back = deepseek.config_to_hf(cfg)
    assert type(back) is transformers.DeepseekV2Config and back.topk_method == hf_model(kind).config.topk_method
    assert deepseek.config_from_hf(back, name=cfg.name) == cfg
    assert cfg.num_parameters() == sum(p.numel() for p in hf_model(kind).parameters())
    assert not any(name.endswith("expert_bias") for name in full)  # no routing bias in V2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_logits_equal_transformers(kind, layout):
    cfg, full = read_hf_dir(hf_dir(kind))
    for logits in logits_at(layout, cfg, full):
        deviation = (logits - hf_logits(kind)).abs().max().item()
        assert deviation < 1e-5, f"{kind} {layout}: max |logit difference| {deviation:.2e}"


def test_group_limit_and_scale_change_the_logits():
    """The grouped config's group limit (scored by the best probability) and routed scale each change the logits:
    without either the parity above could not tell them apart from plain greedy routing."""
    cfg, full = read_hf_dir(hf_dir("v2_grouped"))
    want = hf_logits("v2_grouped")
    for change in (dict(moe_n_group=1, moe_topk_group=1), dict(moe_routed_scaling_factor=1.0)):
        deviation = (megazoo_logits(Topology.solo(), cfg.replace(**change), full) - want).abs().max().item()
        assert deviation > 1e-3, (change, deviation)


@pytest.mark.parametrize("kind", KINDS)
def test_convert_both_ways_verified(kind, tmp_path, capsys):
    ckpt, again = tmp_path / "ckpt", tmp_path / "again"
    assert megazoo(["convert", "hf-to-megazoo", hf_dir(kind), "--out", ckpt, "--verify"]) == 0
    assert megazoo(["convert", "megazoo-to-hf", ckpt, "--out", again, "--verify"]) == 0
    out = capsys.readouterr().out
    assert out.count("logits (max abs difference)") == 2 and "FAIL" not in out, out
    config = json.loads((again / "config.json").read_text())
    assert config["model_type"] == "deepseek_v2" and config["architectures"] == ["DeepseekV2ForCausalLM"]
    first, second = safetensors_state(hf_dir(kind)), safetensors_state(again)
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(second[name], value), name
    model = transformers.AutoModelForCausalLM.from_pretrained(str(again), attn_implementation="eager").eval()
    with torch.no_grad():
        assert (model(IDS).logits - hf_logits(kind)).abs().max().item() == 0.0


def test_v2_lite_preset_is_written_as_deepseek_v2():
    """The deepseek-v2-lite preset (16B): its DeepseekV2Config builds, on the meta device, a model with the preset's
    exact total and active counts (test_deepseek_presets holds them to the published config), and reads back."""
    cfg = get_preset("deepseek-v2-lite")
    hf = deepseek.config_to_hf(cfg)
    assert type(hf) is transformers.DeepseekV2Config and hf.topk_method == "greedy" and hf.q_lora_rank is None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters()) == 15_706_484_224
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert cfg.num_active_parameters() == 15_706_484_224 - routed * (64 - 6) // 64 == 2_661_150_208
    # the training-only balance loss is no HF field: the rest reads back as the preset
    assert deepseek.config_from_hf(hf, name=cfg.name) == cfg.replace(moe_aux_loss_coef=0.0)
