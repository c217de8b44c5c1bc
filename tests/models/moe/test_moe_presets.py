"""The Mixtral, Qwen3-MoE, Qwen2-MoE and Qwen3 presets are their published Hugging Face configs: total and active
parameter counts equal transformers' own models built from those configs on the meta device (nothing allocated,
nothing downloaded). The config values below are copied from the checkpoints' config.json files (the fields that
shape the model), independently of models/mixtral/ and models/qwen3/. Active parameters of transformers' model:
all of them but, in each MoE layer, (E - k) / E of its stacked experts' tensors."""

from __future__ import annotations

import pytest
import torch
import transformers

from megazoo.models.flops import model_flops_per_token
from megazoo.models.hf.moe_families import config_from_hf
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import count_parameters
from megazoo.parallel.topology import Topology

_QWEN = dict(vocab_size=151936, hidden_act="silu", rms_norm_eps=1e-06, rope_theta=1000000.0, initializer_range=0.02)
_QWEN3 = dict(_QWEN, head_dim=128, max_position_embeddings=40960, attention_bias=False, use_sliding_window=False)
_MIXTRAL = dict(hidden_act="silu", rms_norm_eps=1e-05, rope_theta=1000000.0, num_local_experts=8,
                num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None, initializer_range=0.02)
PUBLISHED = {  # preset: (config class, config.json fields)
    "mixtral-8x7b": (transformers.MixtralConfig, dict(_MIXTRAL, vocab_size=32000, hidden_size=4096,
                     intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=32768, router_aux_loss_coef=0.02)),
    "mixtral-8x22b": (transformers.MixtralConfig, dict(_MIXTRAL, vocab_size=32768, hidden_size=6144,
                      intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
                      max_position_embeddings=65536, router_aux_loss_coef=0.001)),
    "qwen3-30b-a3b": (transformers.Qwen3MoeConfig, dict(_QWEN3, hidden_size=2048, intermediate_size=6144,
                      moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                      num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], tie_word_embeddings=False, router_aux_loss_coef=0.001)),
    "qwen3-235b-a22b": (transformers.Qwen3MoeConfig, dict(_QWEN3, hidden_size=4096, intermediate_size=12288,
                        moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                        num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                        router_aux_loss_coef=0.001)),
    "qwen2-57b-a14b": (transformers.Qwen2MoeConfig, dict(_QWEN, hidden_size=3584, intermediate_size=18944,
                       moe_intermediate_size=2560, shared_expert_intermediate_size=20480, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, num_experts=64, num_experts_per_tok=8,
                       norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                       max_position_embeddings=131072, tie_word_embeddings=False, router_aux_loss_coef=0.001)),
    "qwen3-0.6b": (transformers.Qwen3Config, dict(_QWEN3, hidden_size=1024, intermediate_size=3072,
                   num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-1.7b": (transformers.Qwen3Config, dict(_QWEN3, hidden_size=2048, intermediate_size=6144,
                   num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-4b": (transformers.Qwen3Config, dict(_QWEN3, hidden_size=2560, intermediate_size=9728,
                 num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-8b": (transformers.Qwen3Config, dict(_QWEN3, hidden_size=4096, intermediate_size=12288,
                 num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)),
    "qwen3-14b": (transformers.Qwen3Config, dict(_QWEN3, hidden_size=5120, intermediate_size=17408,
                  num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False)),
    "qwen3-32b": (transformers.Qwen3Config, dict(_QWEN3, hidden_size=5120, intermediate_size=25600,
                  num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)),
}
EXACT = {  # (total, active); the model cards quote 46.7B / 12.9B, 141B / 39B, 30.5B / 3.3B, 235B / 22B, 57B / 14B
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
    "mixtral-8x22b": (140_630_071_296, 39_161_468_928),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520),
    "qwen2-57b-a14b": (57_408_658_944, 14_249_270_784),
    "qwen3-0.6b": (596_049_920, 596_049_920),
    "qwen3-1.7b": (1_720_574_976, 1_720_574_976),
    "qwen3-4b": (4_022_468_096, 4_022_468_096),
    "qwen3-8b": (8_190_735_360, 8_190_735_360),
    "qwen3-14b": (14_768_307_200, 14_768_307_200),
    "qwen3-32b": (32_762_123_264, 32_762_123_264)}


def hf_config(name: str):
    config_class, fields = PUBLISHED[name]
    return config_class(**fields)


def hf_meta_counts(name: str) -> tuple[int, int]:
    config = hf_config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            experts = sum(p.numel() for p in layer.mlp.experts.parameters())
            e, k = config.num_local_experts if name.startswith("mixtral") else config.num_experts, \
                config.num_experts_per_tok
            idle += experts // e * (e - k)
    return total, total - idle


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_counts_equal_transformers_on_meta(name):
    preset = get_preset(name)
    total, active = hf_meta_counts(name)
    assert (preset.num_parameters(), preset.num_active_parameters()) == (total, active)
    assert (total, active) == EXACT[name]
    assert count_parameters(GPT(preset, Topology.solo(), device="meta"), preset.vocab_size) == total


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_is_the_published_config(name):
    ours = config_from_hf(hf_config(name), name=name)
    preset = get_preset(name)
    fields = ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim", "vocab_size", "qk_norm", "qkv_bias",
              "tie_embeddings", "n_experts", "moe_top_k", "moe_d_ff", "moe_shared_experts", "moe_shared_d_ff",
              "moe_shared_gate", "moe_norm_topk_prob", "moe_every", "moe_dense_layers", "rope_theta",
              "layer_norm_eps", "n_positions", "moe_aux_loss_coef")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(preset, f) for f in fields}


def test_flops_count_the_active_parameters():
    """6 x active matmul parameters: Qwen3-30B-A3B's FLOPs per token are those of its ~3B active weights."""
    cfg = get_preset("qwen3-30b-a3b")
    attention = 12.0 * cfg.n_layer * 4096 * cfg.n_head * cfg.head_dim
    norms = cfg.n_layer * (2 * cfg.d_model + 2 * cfg.head_dim) + cfg.d_model  # not matmul weights
    embedding = cfg.vocab_size * cfg.d_model  # the input embedding is a lookup; the head (as big) is a matmul
    assert model_flops_per_token(cfg, 4096) == 6.0 * (cfg.num_active_parameters() - norms - embedding) + attention
    dense = get_preset("qwen3-8b")
    norms = dense.n_layer * (2 * dense.d_model + 2 * dense.head_dim) + dense.d_model
    assert model_flops_per_token(dense, 4096) == 6.0 * (dense.num_parameters() - norms - 0) + \
        12.0 * dense.n_layer * 4096 * dense.n_head * dense.head_dim - 6.0 * dense.vocab_size * dense.d_model
