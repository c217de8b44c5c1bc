"""DeepSeek-V3 / V3.1 (671B, 37B active), DeepSeek-V2-Lite (16B, 2.4B active), Kimi K2 (1.04T, 32B active) and a
tiny DeepSeek-style model for tests and demos.

Each big preset is its published Hugging Face config.json, field for field (kv_lora_rank, q_lora_rank,
qk_*_head_dim, v_head_dim as they are; n_routed_experts -> n_experts, num_experts_per_tok -> moe_top_k,
moe_intermediate_size -> moe_d_ff, n_shared_experts -> moe_shared_experts, first_k_dense_replace ->
moe_first_dense, n_group / topk_group -> moe_n_group / moe_topk_group, rope_scaling's yarn fields -> rope_*).
The multi-token-prediction layer the checkpoints carry (num_nextn_predict_layers) is not counted: transformers'
model does not build it. tests/models/deepseek/test_deepseek_presets.py holds the total and active counts equal
to transformers' DeepseekV3 (V2-Lite: DeepseekV2) models on the meta device. Training-only fields follow the
DeepSeek-V3 report: routing-bias speed 0.001, sequence-wise balance loss 0.0001.
"""

from megazoo.models.config import ModelConfig

_MLA = dict(norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False, qkv_bias=False, proj_bias=False,
            mlp_bias=False, dropout=0.0, attn_dropout=0.0, init_std=0.02, layer_norm_eps=1e-6,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_V3 = dict(_MLA, n_layer=61, d_model=7168, d_ff=18432, moe_d_ff=2048, q_lora_rank=1536, moe_top_k=8,
           moe_shared_experts=1, moe_router="sigmoid_bias", moe_norm_topk_prob=True, moe_bias_update_rate=0.001,
           moe_seq_aux_loss_coef=0.0001, rope_scaling="yarn", rope_original_positions=4096, rope_beta_fast=32.0,
           rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0)

PRESETS = (
    # deepseek-ai/DeepSeek-V3 (and -V3.1: the same shapes): 256 routed experts in 8 groups, a token's from 4.
    *(ModelConfig(name, n_head=128, vocab_size=129280, n_positions=163840, n_experts=256, moe_first_dense=3,
                  moe_n_group=8, moe_topk_group=4, moe_routed_scaling_factor=2.5, rope_theta=10000.0,
                  rope_factor=40.0, **_V3) for name in ("deepseek-v3", "deepseek-v3.1")),
    # moonshotai/Kimi-K2-Instruct (-Base the same): 384 experts, no groups, 64 heads, one dense layer.
    ModelConfig("kimi-k2", n_head=64, vocab_size=163840, n_positions=131072, n_experts=384, moe_first_dense=1,
                moe_routed_scaling_factor=2.827, rope_theta=50000.0, rope_factor=32.0,
                **dict(_V3, rope_beta_fast=1.0)),
    # deepseek-ai/DeepSeek-V2-Lite: no q compression, softmax routing (top-6 of 64, not renormalised), 2 shared
    # experts. Its sequence-wise softmax balance loss (seq_aux, alpha 0.001) is not built for softmax routing:
    # the Switch-style moe_aux_loss_coef 0.001 stands in for it.
    ModelConfig("deepseek-v2-lite", n_layer=27, n_head=16, d_model=2048, d_ff=10944, vocab_size=102400,
                n_positions=163840, n_experts=64, moe_top_k=6, moe_d_ff=1408, moe_shared_experts=2,
                moe_first_dense=1, moe_norm_topk_prob=False, moe_aux_loss_coef=0.001, rope_theta=10000.0,
                rope_scaling="yarn", rope_factor=40.0, rope_original_positions=4096, rope_mscale=0.707,
                rope_mscale_all_dim=0.707, **_MLA),
    # Tiny: MLA with q compression, 8 sigmoid-routed experts in 4 groups (a token's from 2), first layer dense.
    ModelConfig("deepseek-tiny", n_layer=3, n_head=4, d_model=64, d_ff=128, vocab_size=32000, n_positions=256,
                n_experts=8, moe_top_k=2, moe_d_ff=32, moe_shared_experts=1, moe_first_dense=1, moe_n_group=4,
                moe_topk_group=2, moe_routed_scaling_factor=2.5, moe_router="sigmoid_bias", moe_norm_topk_prob=True,
                moe_bias_update_rate=0.001, **dict(_MLA, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                                                   qk_rope_head_dim=8, v_head_dim=16)),
)
