"""Tiny random transformers DeepseekV3ForCausalLM (and DeepseekV2ForCausalLM: v2_config) models (no download) that
the DeepSeek tests share: "qlora"
(q compression, group-limited routing 4 groups / top 2, routed scale 2.5, first layer dense, 2 shared experts,
default rope) and "plain_q" (no q compression, as V2-Lite, and YaRN with mscale != mscale_all_dim, so both the
cos / sin factor and the softmax-scale correction act; the sequence runs past the original context)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch
import transformers

V = 300
IDS = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.8)


def hf_config(kind: str):
    if kind.startswith("v2_"):
        return v2_config(kind)
    return transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=24, q_lora_rank=16 if kind == "qlora" else None,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters=YARN if kind == "plain_q" else dict(rope_type="default", rope_theta=10000.0))


def v2_config(kind: str):
    """transformers' DeepseekV2: "v2_lite" as V2-Lite (no q compression, softmax top-k over all experts, scale 1, YaRN);
    "v2_grouped" as V2 (q compression, top-3 by group_limited_greedy in 2 of 4 groups, routed scale 2.5)."""
    lite = kind == "v2_lite"
    return transformers.DeepseekV2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
        routed_scaling_factor=1.0 if lite else 2.5, kv_lora_rank=24, q_lora_rank=None if lite else 16,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=1 if lite else 4, topk_group=1 if lite else 2,
        topk_method="greedy" if lite else "group_limited_greedy", norm_topk_prob=False,
        num_experts_per_tok=2 if lite else 3,  # the group limit (by the best) only bites where top-k > topk_group
        first_k_dense_replace=1, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters=YARN if lite else dict(rope_type="default", rope_theta=10000.0))


@functools.lru_cache(maxsize=None)
def hf_model(kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind), attn_implementation="eager")
    with torch.no_grad():  # random norms, routers and routing biases (HF initialises them to 1 / 0)
        for name, p in model.named_parameters():
            if "norm" in name or ".gate." in name:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.eval()


@functools.lru_cache(maxsize=None)
def hf_logits(kind: str) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(kind)(IDS).logits


@functools.lru_cache(maxsize=None)
def hf_dir(kind: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"deepseek-{kind}-")) / f"tiny-deepseek-{kind}"
    hf_model(kind).save_pretrained(str(path))
    return path


def megazoo_logits(topo, cfg, full) -> torch.Tensor:
    """Our decoder built from the full HF state at `topo`, on IDS, its vocabulary gathered over tp."""
    from megazoo.models.hf.gpt2 import gpt_from_full_state
    from megazoo.parallel.tensor import gather_from_tp_region
    model = gpt_from_full_state(cfg, full, topo)
    with torch.no_grad():
        return gather_from_tp_region(model(IDS), topo.tp_group)[..., :V]


LAYOUTS = {"tp1": None, "tp2": dict(dp=1, tp=2), "tp2-sp": dict(dp=1, tp=2, sequence_parallel=True),
           "ep2": dict(dp=2, ep=2)}


def logits_at(layout: str, cfg, full) -> list[torch.Tensor]:
    """megazoo_logits at one of LAYOUTS: one process, or every rank of two gloo processes."""
    from harness import run_distributed

    from megazoo.parallel.topology import Topology
    if LAYOUTS[layout] is None:
        return [megazoo_logits(Topology.solo(), cfg, full)]
    return run_distributed(lambda: megazoo_logits(Topology.build(**LAYOUTS[layout]), cfg, full), 2)
