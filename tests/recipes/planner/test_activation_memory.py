"""The activation formula (recipes/planner/activations.py, Korthikanti et al. 2022) against what autograd really keeps.

A small GPT (fp32, CPU) runs forward + backward; torch.autograd.graph.saved_tensors_hooks sees every tensor
saved for backward, and the bytes of their distinct storages (parameters excluded) are the activation memory.
At two sequence lengths and two micro-batches, with materialised attention scores (kernels.attention =
"reference") and with fused SDPA, with and without dropout, the formula must match the total and its growth
within TOLERANCE (measured: 0.3-0.8 % over the formula, the LayerNorms' per-row mean and rstd it leaves out).
On the CPU, torch keeps dropout masks in the activation dtype (mask_bytes = 4) and SDPA with dropout falls back
to the math path (it stores the scores), so SDPA is checked without dropout.
"""

from __future__ import annotations

import pytest
import torch

from megazoo.kernels.dispatch import KernelChoice
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.parallel.topology import Topology
from megazoo.recipes.planner.activations import (ActivationSpec, checkpoint_bytes, in_flight, korthikanti, layer_bytes,
                                         stage_activations)

TOLERANCE = 0.03  # relative


def measured_bytes(cfg, b: int, s: int, attention: str, packed: bool = False) -> int:
    torch.manual_seed(0)
    model = GPT(cfg, Topology.solo(), kernels=KernelChoice("auto", {"attention": attention}))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randint(0, cfg.vocab_size, (b, s))
    # packed: each row holds examples of s / 4, s / 2 and s / 4 tokens (models/packing.py)
    ids = torch.cat([torch.full((b, n), i + 1) for i, n in enumerate((s // 4, s // 2, s - 3 * s // 4))], dim=1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(model(x, segment_ids=ids if packed else None), x)
    loss.backward()
    return sum(saved.values())


def predicted_bytes(cfg, b: int, s: int, attention: str, packed: bool = False) -> float:
    spec = ActivationSpec.for_model(cfg, element_bytes=4, mask_bytes=4, flash_attention=attention == "torch",
                                    packed=packed)
    return stage_activations(cfg, s, b, 1, [cfg.n_layer], spec=spec)[0].total_bytes


@pytest.mark.parametrize("attention, dropout", [("reference", 0.0), ("reference", 0.1), ("torch", 0.0)])
def test_formula_matches_saved_tensors(attention, dropout):
    cfg = get_preset("gpt2-tiny").replace(n_layer=2, vocab_size=512, dropout=dropout, attn_dropout=dropout)
    points = [(2, 64), (2, 128), (4, 64)]
    measured = {p: measured_bytes(cfg, *p, attention) for p in points}
    predicted = {p: predicted_bytes(cfg, *p, attention) for p in points}
    for p in points:
        assert abs(measured[p] / predicted[p] - 1) < TOLERANCE, (p, measured[p], predicted[p])
    for a, b in ((points[0], points[1]), (points[0], points[2])):  # growth with the sequence and the micro-batch
        grew, formula = measured[b] - measured[a], predicted[b] - predicted[a]
        assert abs(grew / formula - 1) < TOLERANCE, (a, b, grew, formula)
    if attention == "reference":  # the s^2 term: doubling s more than doubles the activations
        assert measured[(2, 128)] > 2.1 * measured[(2, 64)]


@pytest.mark.parametrize("attention", ["reference", "torch"])
def test_formula_matches_latent_attention(attention):
    """DeepSeek's multi-head latent attention (models/deepseek/mla.py): q, k, v padded to one width, the latents
    replicated over tp; V3-like proportions (n_head x (nope + rope) = 1.5 h, v narrower than q / k)."""
    cfg = get_preset("deepseek-tiny").replace(
        n_layer=2, d_model=256, n_head=8, d_ff=512, vocab_size=512, n_experts=0, moe_router="softmax", moe_n_group=1,
        moe_topk_group=1, moe_routed_scaling_factor=1.0, moe_bias_update_rate=0.0, moe_shared_experts=0,
        moe_first_dense=0, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    for p in [(2, 64), (2, 128)]:
        measured, predicted = measured_bytes(cfg, *p, attention), predicted_bytes(cfg, *p, attention)
        assert abs(measured / predicted - 1) < TOLERANCE, (p, measured, predicted)


def test_per_layer_formula_is_the_papers_at_16_bits():
    s, b, h, a = 2048, 1, 12288, 96
    for t in (1, 2, 8):
        assert layer_bytes(s, b, h, a, t) == pytest.approx(korthikanti(s, b, h, a, t))
    assert layer_bytes(s, b, h, a, 1) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert checkpoint_bytes(s, b, h) == 2 * s * b * h
    no_dropout = ActivationSpec(dropout=False, attn_dropout=False)
    assert layer_bytes(s, b, h, a, 1, no_dropout) == pytest.approx(s * b * h * 32 + 2 * a * s * s * b)
    flash = ActivationSpec(flash_attention=True)
    assert layer_bytes(s, b, h, a, 4, flash) == pytest.approx(s * b * h * (10 + 24 / 4) + 4 * a * s * b / 4)


def test_pipeline_in_flight_and_checkpointing():
    assert [in_flight("1f1b", 4, r, 16) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 0, 2) == 2 and in_flight("gpipe", 4, 3, 16) == 16 and in_flight("1f1b", 1, 0, 8) == 1
    # ZB-H1 holds each micro-batch from F to its deferred W: pp on every rank, as the engine counts
    # (tests/parallel/pipeline/test_pipeline.py); its peak is 1F1B's first stage's
    assert [in_flight("zb_h1", 4, r, 16) for r in range(4)] == [4, 4, 4, 4] and in_flight("zb_h1", 4, 2, 3) == 3
    cfg = get_preset("gpt2-1.5b")
    full = stage_activations(cfg, 1024, 4, 1, [12] * 4, micro_batches=8)
    ckpt = stage_activations(cfg, 1024, 4, 1, [12] * 4, micro_batches=8, checkpointing=True)
    assert full[0].total_bytes > full[1].total_bytes and ckpt[0].total_bytes < full[0].total_bytes / 5
    one_layer = layer_bytes(1024, 4, cfg.d_model, cfg.n_head)
    assert ckpt[0].total_bytes == pytest.approx(4 * (12 * 2 * 1024 * 4 * cfg.d_model + ckpt[0].extra_bytes)
                                                + one_layer)


@pytest.mark.parametrize("attention", ["reference", "torch"])
def test_formula_matches_saved_tensors_for_the_llama_block(attention):
    """RMSNorm, rotary, SwiGLU (d_ff = 3.5 h: 14 h per token instead of GELU's 8) and grouped-query attention."""
    cfg = get_preset("llama-tiny").replace(n_layer=2, vocab_size=512, d_ff=448)
    points = [(2, 64), (2, 128), (4, 64)]
    measured = {p: measured_bytes(cfg, *p, attention) for p in points}
    predicted = {p: predicted_bytes(cfg, *p, attention) for p in points}
    for p in points:
        assert abs(measured[p] / predicted[p] - 1) < TOLERANCE, (p, measured[p], predicted[p])
    for a, b in ((points[0], points[1]), (points[0], points[2])):
        grew, formula = measured[b] - measured[a], predicted[b] - predicted[a]
        assert abs(grew / formula - 1) < TOLERANCE, (a, b, grew, formula)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_packed_rows_keep_no_scores_and_no_mask(preset):
    """Packed SFT rows under the materialising attention kernel ("reference"): the examples' attention runs per
    example through SDPA, so what autograd keeps is the fused-attention formula (no s^2 term, no s x s mask),
    never more than the same rows unpacked."""
    cfg = get_preset(preset).replace(n_layer=2, vocab_size=512, dropout=0.0, attn_dropout=0.0)
    if cfg.d_ff:
        cfg = cfg.replace(d_ff=448)
    points = [(2, 64), (2, 128), (4, 64)]
    measured = {p: measured_bytes(cfg, *p, "reference", packed=True) for p in points}
    predicted = {p: predicted_bytes(cfg, *p, "reference", packed=True) for p in points}
    for p in points:
        assert abs(measured[p] / predicted[p] - 1) < TOLERANCE, (p, measured[p], predicted[p])
        assert measured[p] < measured_bytes(cfg, *p, "reference")  # packing costs no more than padding
    grew, formula = measured[(2, 128)] - measured[(2, 64)], predicted[(2, 128)] - predicted[(2, 64)]
    assert abs(grew / formula - 1) < TOLERANCE, (grew, formula)  # linear in s: no s^2 term
