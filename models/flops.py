"""Model FLOPs per token, for model FLOPs utilisation (MFU) in the step metrics and the planner.

MFU as PaLM defines it: the FLOPs the model needs (not counting activation recomputation) per second, over
the hardware's peak. Per token of training: 6 x the parameters that take part in matmuls (forward 2, backward
4) plus 12 x layers x sequence x hidden for the attention scores and their weighted sum (q k^T and p v, full
square, the usual convention). The hardware's peak is recipes/gpus.py's peak_flops.
"""

from __future__ import annotations

from megazoo.models.config import ModelConfig


def block_matmul_params(cfg: ModelConfig) -> int:
    """Weights one block multiplies by: Q and the output projection (d x n_head hd each), K and V (d x n_kv_head hd
    each: grouped-query attention's are smaller), and the MLP's 2 (GELU) or 3 (SwiGLU: gate, up, down)
    d x d_ff matrices. GPT-2: 4 d^2 + 2 d d_ff."""
    d, hd = cfg.d_model, cfg.head_dim
    mlp_matrices = 3 if cfg.mlp == "swiglu" else 2
    return 2 * d * cfg.n_head * hd + 2 * d * cfg.n_kv_head * hd + mlp_matrices * d * cfg.d_ff


def model_flops_per_token(cfg: ModelConfig, seq_len: int, vocab: int | None = None) -> float:
    """Training FLOPs per token: 6 x matmul parameters (blocks + the output head, tied or not) + 12 x L x s' x
    n_head hd, with s' the keys a query sees: the sequence, or at most the sliding window."""
    d, vocab = cfg.d_model, vocab or cfg.vocab_size
    matmul_params = cfg.n_layer * block_matmul_params(cfg) + vocab * d
    keys = min(seq_len, cfg.sliding_window) if cfg.sliding_window else seq_len
    return 6.0 * matmul_params + 12.0 * cfg.n_layer * keys * cfg.n_head * cfg.head_dim

