"""Model FLOPs per token, for model FLOPs utilisation (MFU) in the step metrics and the planner.

MFU as PaLM defines it: the FLOPs the model needs (not counting activation recomputation) per second, over
the hardware's peak. Per token of training: 6 x the parameters that take part in matmuls (forward 2, backward
4) plus 12 x layers x sequence x hidden for the attention scores and their weighted sum (q k^T and p v, full
square, the usual convention). The hardware's peak is recipes/gpus.py's peak_flops.

Mixture of experts: only the parameters a token uses count (the MFU convention of Megatron-core and torchtitan
for MoE): the router, the k routed experts it is sent to, the shared experts and their gate; the other E - k
experts' weights do no work for it. Multi-token prediction's modules count as trained (DeepSeek-V3's report
does not say whether its MFU counts them). Dropped tokens (a capacity factor) are not subtracted: the count is the
model's, not the run's.
"""

from __future__ import annotations

from megazoo.models.config import ModelConfig


def attention_matmul_params(cfg: ModelConfig) -> int:
    """Q and the output projection (d x n_head hd each), K and V (d x n_kv_head hd each: grouped-query
    attention's are smaller). Latent attention: its down-projections, up-projections and output projection."""
    if cfg.mla:
        qk, n, r = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.n_head, cfg.kv_lora_rank
        q = cfg.q_lora_rank * (cfg.d_model + n * qk) if cfg.q_lora_rank else cfg.d_model * n * qk
        return q + cfg.d_model * (r + cfg.qk_rope_head_dim) + r * n * (cfg.qk_nope_head_dim + cfg.v_head_dim) + \
            n * cfg.v_head_dim * cfg.d_model
    d, hd = cfg.d_model, cfg.head_dim
    return 2 * d * cfg.n_head * hd + 2 * d * cfg.n_kv_head * hd


def block_matmul_params(cfg: ModelConfig) -> int:
    """Weights one dense block multiplies by: the attention's and the MLP's 2 (GELU) or 3 (SwiGLU: gate, up,
    down) d x d_ff matrices. GPT-2: 4 d^2 + 2 d d_ff."""
    mlp_matrices = 3 if cfg.mlp == "swiglu" else 2
    return attention_matmul_params(cfg) + mlp_matrices * cfg.d_model * cfg.d_ff


def layer_matmul_params(cfg: ModelConfig, index: int) -> int:
    """Weights block `index` multiplies one token by: block_matmul_params for a dense block; for an MoE block the
    attention's, the router's E x d, moe_top_k experts' 3 d moe_d_ff, the shared experts' 3 d width and their
    gate's d."""
    if not cfg.moe_layer(index):
        return block_matmul_params(cfg)
    d = cfg.d_model
    shared = 3 * d * cfg.moe_shared_experts * cfg.moe_shared_d_ff + (d if cfg.moe_shared_gate else 0)
    return attention_matmul_params(cfg) + cfg.n_experts * d + cfg.moe_top_k * 3 * d * cfg.moe_d_ff + shared


def model_flops_per_token(cfg: ModelConfig, seq_len: int, vocab: int | None = None) -> float:
    """Training FLOPs per token: 6 x matmul parameters a token uses (blocks + the output head, tied or not) + 12 x
    L x s' x n_head hd, with s' the keys a query sees: the sequence, or at most the sliding window."""
    d, vocab, depth = cfg.d_model, vocab or cfg.vocab_size, cfg.mtp_depth
    matmul_params = sum(layer_matmul_params(cfg, i) for i in range(cfg.n_layer)) + vocab * d
    # multi-token prediction (trained with the model): per depth its 2d -> d projection, its block (layer
    # n_layer + k - 1) and the shared head once more
    matmul_params += sum(2 * d * d + layer_matmul_params(cfg, cfg.n_layer + k) + vocab * d for k in range(depth))
    keys = min(seq_len, cfg.sliding_window) if cfg.sliding_window else seq_len
    if cfg.mla:  # q k^T over nope + rope dims, p v over v_head_dim: 6 x L x s' x n_head x (qk + v)
        widths = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
        return 6.0 * matmul_params + 6.0 * (cfg.n_layer + depth) * keys * cfg.n_head * widths
    return 6.0 * matmul_params + 12.0 * (cfg.n_layer + depth) * keys * cfg.n_head * cfg.head_dim
