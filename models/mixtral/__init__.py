"""Mixtral presets: Llama-style blocks (RMSNorm, rotary, grouped-query attention) whose MLP is 8 routed SwiGLU
experts in every layer, each token using 2, renormalised (models/moe/).

Each preset is the published Hugging Face config.json, field for field (intermediate_size -> d_ff and moe_d_ff,
num_local_experts -> n_experts, num_experts_per_tok -> moe_top_k, router_aux_loss_coef -> moe_aux_loss_coef);
tests/models/moe/test_moe_presets.py holds the total and active parameter counts equal to transformers' own
models built from those configs on the meta device.
"""

from megazoo.models.config import ModelConfig

_MIXTRAL = dict(norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False, qkv_bias=False,
                proj_bias=False, mlp_bias=False, dropout=0.0, attn_dropout=0.0, init_std=0.02, layer_norm_eps=1e-5,
                rope_theta=1000000.0, n_experts=8, moe_top_k=2, moe_norm_topk_prob=True)

PRESETS = (
    # A tiny Mixtral for tests and demos: 4 experts, top-2, widths the grouped matmul takes (multiples of 8).
    ModelConfig("mixtral-tiny", n_layer=4, n_head=4, n_kv_head=2, d_model=64, d_ff=64, n_positions=256,
                vocab_size=32000, **dict(_MIXTRAL, n_experts=4, rope_theta=10000.0, moe_aux_loss_coef=0.02)),
    # mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active.
    ModelConfig("mixtral-8x7b", n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, n_positions=32768,
                vocab_size=32000, **dict(_MIXTRAL, moe_aux_loss_coef=0.02)),
    # mistralai/Mixtral-8x22B-v0.1: 141B parameters, 39B active.
    ModelConfig("mixtral-8x22b", n_layer=56, n_head=48, n_kv_head=8, d_model=6144, d_ff=16384, n_positions=65536,
                vocab_size=32768, **dict(_MIXTRAL, moe_aux_loss_coef=0.001)),
)
