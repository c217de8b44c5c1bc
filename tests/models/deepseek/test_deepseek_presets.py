"""DeepSeek-V3 / V3.1, Kimi K2 and DeepSeek-V2-Lite presets are their published Hugging Face configs: total and
active parameter counts equal transformers' DeepseekV3 (V2-Lite: DeepseekV2) models built from those configs on the
meta device (nothing allocated or downloaded); the values below are copied from the checkpoints' config.json files
independently of models/deepseek/presets.py. Active: all parameters but, in each MoE layer, (E - k) / E of its
stacked experts' tensors. Also: our meta-device GPT allocates exactly that many, and the FLOPs count MLA's
matrices (the active matmul parameters)."""

from __future__ import annotations

import pytest
import torch
import transformers

from megazoo.models.deepseek.hf import config_from_hf
from megazoo.models.flops import model_flops_per_token
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import count_parameters
from megazoo.parallel.topology import Topology

_V3 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
           n_shared_experts=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
           qk_nope_head_dim=128, num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6,
           tie_word_embeddings=False, initializer_range=0.02, attention_bias=False)
PUBLISHED = {
    "deepseek-v3": (transformers.DeepseekV3Config, dict(
        _V3, vocab_size=129280, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        routed_scaling_factor=2.5, n_group=8, topk_group=4, first_k_dense_replace=3, max_position_embeddings=163840,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000, factor=40, original_max_position_embeddings=4096,
                             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
    "kimi-k2": (transformers.DeepseekV3Config, dict(
        _V3, vocab_size=163840, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
        routed_scaling_factor=2.827, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=4096,
                             beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
    "deepseek-v2-lite": (transformers.DeepseekV2Config, dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6,
        first_k_dense_replace=1, norm_topk_prob=False, hidden_act="silu", max_position_embeddings=163840,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000, factor=40, original_max_position_embeddings=4096,
                             beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707))),
}
PUBLISHED["deepseek-v3.1"] = PUBLISHED["deepseek-v3"]  # V3.1 changed training, not shapes
EXACT = {  # (total, active) without the MTP layer; the model cards: 671B / 37B, 1T / 32B, 15.7B / 2.4B (V2-Lite's
    # card leaves the embedding out of the active count: 2.66B - 0.21B)
    "deepseek-v3": (671_026_404_352, 37_552_282_624), "deepseek-v3.1": (671_026_404_352, 37_552_282_624),
    "kimi-k2": (1_026_408_209_408, 32_861_477_888), "deepseek-v2-lite": (15_706_484_224, 2_661_150_208)}


def hf_meta_counts(name: str) -> tuple[int, int]:
    config_class, fields = PUBLISHED[name]
    config = config_class(**fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            experts = sum(p.numel() for p in layer.mlp.experts.parameters())
            idle += experts // config.n_routed_experts * (config.n_routed_experts - config.num_experts_per_tok)
    return total, total - idle


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_counts_equal_transformers_on_meta(name):
    preset = get_preset(name)
    total, active = hf_meta_counts(name)
    assert (preset.num_parameters(), preset.num_active_parameters()) == (total, active)
    assert (total, active) == EXACT[name]
    assert count_parameters(GPT(preset, Topology.solo(), device="meta"), preset.vocab_size) == total


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_preset_is_the_published_config(name):
    config_class, fields = PUBLISHED[name]
    ours = config_from_hf(config_class(**fields), name=name)
    preset = get_preset(name)
    training = ("moe_bias_update_rate", "moe_seq_aux_loss_coef")  # the report's, not in config.json
    assert ours == preset.replace(**{f: 0.0 for f in training})


def test_flops_count_mla_matrices():
    cfg = get_preset("deepseek-v3")
    n, d = cfg.n_head, cfg.d_model
    mla = 1536 * (d + n * 192) + d * (512 + 64) + 512 * n * 256 + n * 128 * d
    layer0 = mla + 3 * d * cfg.d_ff
    assert model_flops_per_token(cfg.replace(n_layer=1, n_experts=0), 1) == \
        6.0 * (layer0 + cfg.vocab_size * d) + 6.0 * n * (192 + 128)
