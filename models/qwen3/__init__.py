"""Qwen3 dense, Qwen3-MoE and Qwen2-MoE presets.

Qwen3: Llama-style blocks with 128-wide heads (head_width, not d_model / n_head) and per-head q/k RMSNorm, no bias.
Qwen3-MoE: the same attention, 128 routed experts in every layer (mlp_only_layers -> moe_dense_layers, empty in the
published configs), top-8 renormalised. Qwen2-MoE: Qwen2's attention (q/k/v bias), 64 routed experts, top-8 not
renormalised, and one shared expert of its own width scaled by a sigmoid gate.

Each preset is the published Hugging Face config.json, field for field (moe_intermediate_size -> moe_d_ff,
shared_expert_intermediate_size -> moe_shared_d_ff, decoder_sparse_step -> moe_every, norm_topk_prob ->
moe_norm_topk_prob, router_aux_loss_coef -> moe_aux_loss_coef); tests/models/moe/test_moe_presets.py holds the
total and active parameter counts equal to transformers' own models built from those configs on the meta device.
"""

from megazoo.models.config import ModelConfig

_QWEN = dict(norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False, qkv_bias=False, proj_bias=False,
             mlp_bias=False, dropout=0.0, attn_dropout=0.0, init_std=0.02, layer_norm_eps=1e-6, vocab_size=151936,
             rope_theta=1000000.0)
_QWEN3 = dict(_QWEN, head_width=128, qk_norm=True, n_positions=40960)
_QWEN3_MOE = dict(_QWEN3, n_experts=128, moe_top_k=8, moe_norm_topk_prob=True, moe_aux_loss_coef=0.001)
_QWEN2_MOE = dict(_QWEN, qkv_bias=True, n_positions=131072, n_experts=64, moe_top_k=8, moe_norm_topk_prob=False,
                  moe_shared_experts=1, moe_shared_gate=True, moe_aux_loss_coef=0.001)

PRESETS = (
    # Qwen/Qwen3-0.6B, -1.7B, -4B (tied embeddings), -8B, -14B, -32B.
    ModelConfig("qwen3-0.6b", n_layer=28, n_head=16, n_kv_head=8, d_model=1024, d_ff=3072,
                **dict(_QWEN3, tie_embeddings=True)),
    ModelConfig("qwen3-1.7b", n_layer=28, n_head=16, n_kv_head=8, d_model=2048, d_ff=6144,
                **dict(_QWEN3, tie_embeddings=True)),
    ModelConfig("qwen3-4b", n_layer=36, n_head=32, n_kv_head=8, d_model=2560, d_ff=9728,
                **dict(_QWEN3, tie_embeddings=True)),
    ModelConfig("qwen3-8b", n_layer=36, n_head=32, n_kv_head=8, d_model=4096, d_ff=12288, **_QWEN3),
    ModelConfig("qwen3-14b", n_layer=40, n_head=40, n_kv_head=8, d_model=5120, d_ff=17408, **_QWEN3),
    ModelConfig("qwen3-32b", n_layer=64, n_head=64, n_kv_head=8, d_model=5120, d_ff=25600, **_QWEN3),
    # A tiny Qwen3-MoE for tests and demos: 8 experts, top-2, one dense layer (mlp_only_layers = [1]).
    ModelConfig("qwen3-moe-tiny", n_layer=4, n_head=4, n_kv_head=2, d_model=64, d_ff=128,
                **dict(_QWEN3_MOE, n_positions=256, head_width=32, vocab_size=32000, n_experts=8, moe_top_k=2, moe_d_ff=32,
                       moe_dense_layers=(1,))),
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (every layer MoE: mlp_only_layers is [] in both).
    ModelConfig("qwen3-30b-a3b", n_layer=48, n_head=32, n_kv_head=4, d_model=2048, d_ff=6144, moe_d_ff=768,
                **_QWEN3_MOE),
    ModelConfig("qwen3-235b-a22b", n_layer=94, n_head=64, n_kv_head=4, d_model=4096, d_ff=12288, moe_d_ff=1536,
                **_QWEN3_MOE),
    # Qwen/Qwen2-57B-A14B: 64 experts of 2,560, one shared expert of 20,480 behind its sigmoid gate.
    ModelConfig("qwen2-57b-a14b", n_layer=28, n_head=28, n_kv_head=4, d_model=3584, d_ff=18944, moe_d_ff=2560,
                moe_shared_d_ff=20480, **_QWEN2_MOE),
)
