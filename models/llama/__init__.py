"""Llama 3.x, Qwen2.5 and Mistral presets: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Each preset is the published Hugging Face config.json of the checkpoint, field for field (hidden_size ->
d_model, intermediate_size -> d_ff, num_key_value_heads -> n_kv_head, rope_theta and rope_scaling ->
rope_*, rms_norm_eps -> layer_norm_eps, tie_word_embeddings -> tie_embeddings, attention bias -> qkv_bias);
tests/models/test_llama_presets.py holds their parameter counts equal to transformers' own models built from those
configs on the meta device. Dropout is 0, as the checkpoints were trained.
"""

from megazoo.models.config import ModelConfig

# Everything the Llama-style families share; presets override what their config.json states.
_LLAMA = dict(norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False, qkv_bias=False,
              proj_bias=False, mlp_bias=False, dropout=0.0, attn_dropout=0.0, init_std=0.02)
# Llama 3.x: 128,256-token vocabulary, rope theta 500,000, Llama 3.1's rope scaling (8K pretraining context).
_LLAMA3 = dict(_LLAMA, vocab_size=128256, n_positions=131072, layer_norm_eps=1e-5, rope_theta=500000.0,
               rope_scaling="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
               rope_original_positions=8192)
# Qwen2.5: 152,064-token vocabulary, bias on q/k/v only, rope theta 1,000,000.
_QWEN25 = dict(_LLAMA, vocab_size=152064, n_positions=131072, qkv_bias=True, rope_theta=1000000.0)

PRESETS = (
    # A tiny Llama-style model for tests and the demo (grouped-query: 4 query heads share 2 key/value heads).
    ModelConfig("llama-tiny", n_layer=4, n_head=4, n_kv_head=2, d_model=128, d_ff=344, n_positions=256,
                **dict(_LLAMA, layer_norm_eps=1e-5)),
    # meta-llama/Llama-3.2-1B and -3B: tied embeddings, rope factor 32.
    ModelConfig("llama3.2-1b", n_layer=16, n_head=32, n_kv_head=8, d_model=2048, d_ff=8192,
                **dict(_LLAMA3, tie_embeddings=True, rope_factor=32.0)),
    ModelConfig("llama3.2-3b", n_layer=28, n_head=24, n_kv_head=8, d_model=3072, d_ff=8192,
                **dict(_LLAMA3, tie_embeddings=True, rope_factor=32.0)),
    # meta-llama/Llama-3.1-8B, -70B, -405B: untied, rope factor 8.
    ModelConfig("llama3.1-8b", n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336,
                **dict(_LLAMA3, rope_factor=8.0)),
    ModelConfig("llama3.1-70b", n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672,
                **dict(_LLAMA3, rope_factor=8.0)),
    ModelConfig("llama3.1-405b", n_layer=126, n_head=128, n_kv_head=8, d_model=16384, d_ff=53248,
                **dict(_LLAMA3, rope_factor=8.0)),
    # Qwen/Qwen2.5-7B and -72B (base models: 131,072 positions, no sliding window in use).
    ModelConfig("qwen2.5-7b", n_layer=28, n_head=28, n_kv_head=4, d_model=3584, d_ff=18944,
                **dict(_QWEN25, layer_norm_eps=1e-6)),
    ModelConfig("qwen2.5-72b", n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=29568,
                **dict(_QWEN25, layer_norm_eps=1e-5)),
    # mistralai/Mistral-7B-v0.1: 32,000-token vocabulary, sliding window of 4,096 positions.
    ModelConfig("mistral-7b", n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336,
                **dict(_LLAMA, vocab_size=32000, n_positions=32768, layer_norm_eps=1e-5, rope_theta=10000.0,
                       sliding_window=4096)),
)
