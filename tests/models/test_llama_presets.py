"""The Llama 3.x, Qwen2.5 and Mistral presets are their published Hugging Face configs, and their parameter
counts equal transformers' own models built from those configs on the meta device (nothing allocated, nothing
downloaded). The config values below are copied from the checkpoints' config.json files (the fields that shape
the model), in their published spelling (rope_theta / rope_scaling), independently of models/llama/__init__.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megazoo.models.presets import get_preset
from megazoo.models.hf.llama import config_from_hf
from megazoo.models.transformer import GPT
from megazoo.models.weights import count_parameters
from megazoo.parallel.topology import Topology

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=500000.0,
               hidden_act="silu", attention_bias=False, mlp_bias=False, initializer_range=0.02)
PUBLISHED = {  # preset: (config class, config.json fields)
    "llama3.2-1b": (transformers.LlamaConfig, dict(_LLAMA3, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0))),
    "llama3.2-3b": (transformers.LlamaConfig, dict(_LLAMA3, hidden_size=3072, intermediate_size=8192,
                    num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                    tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0))),
    "llama3.1-8b": (transformers.LlamaConfig, dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    tie_word_embeddings=False, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0))),
    "llama3.1-70b": (transformers.LlamaConfig, dict(_LLAMA3, hidden_size=8192, intermediate_size=28672,
                     num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                     tie_word_embeddings=False, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0))),
    "llama3.1-405b": (transformers.LlamaConfig, dict(_LLAMA3, hidden_size=16384, intermediate_size=53248,
                      num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                      tie_word_embeddings=False, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0))),
    "qwen2.5-7b": (transformers.Qwen2Config, dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                   num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
                   max_position_embeddings=131072, rms_norm_eps=1e-06, rope_theta=1000000.0,
                   sliding_window=131072, use_sliding_window=False, max_window_layers=28,
                   tie_word_embeddings=False, initializer_range=0.02)),
    "qwen2.5-72b": (transformers.Qwen2Config, dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_act="silu",
                    max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=1000000.0,
                    sliding_window=131072, use_sliding_window=False, max_window_layers=80,
                    tie_word_embeddings=False, initializer_range=0.02)),
    "mistral-7b": (transformers.MistralConfig, dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                   max_position_embeddings=32768, rms_norm_eps=1e-05, rope_theta=10000.0, sliding_window=4096,
                   tie_word_embeddings=False, initializer_range=0.02)),
}
# The totals as usually quoted (HF model cards / safetensors metadata), for the record in the closing note.
QUOTED = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.1-8b": 8_030_261_248,
          "llama3.1-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800, "qwen2.5-7b": 7_615_616_512,
          "qwen2.5-72b": 72_706_203_648, "mistral-7b": 7_241_732_096}


def hf_config(name: str):
    config_class, fields = PUBLISHED[name]
    return config_class(**fields)


def hf_meta_count(name: str) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(name))
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter, counted once


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_equals_transformers_on_meta(name):
    preset = get_preset(name)
    reference = hf_meta_count(name)
    assert preset.num_parameters() == reference == QUOTED[name]
    ours = GPT(preset, Topology.solo(), device="meta")  # and what our model really allocates
    assert count_parameters(ours, preset.vocab_size) == reference


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_is_the_published_config(name):
    assert config_from_hf(hf_config(name), name=name) == get_preset(name)
