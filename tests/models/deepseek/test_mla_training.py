"""Latent attention in the real Trainer: fp64, 3 steps, every layout equals one process running the same
micro-batches to 1e-10 (losses, gradient norms, every parameter and every layer's routing bias, exactly):
tp 2 with sequence parallelism x ep 2 (the replicated down-projections' and latent norms' gradients summed over
the tp ranks' positions, the latents gathered in one collective), pp 2 x ep 2, cp 2 all-to-all and ring (the shared rotary key
travelling with the heads' keys), dp 2 x ep 2 under ZeRO-3 with activation checkpointing, and the no-q-compression variant (V2-Lite's c_q) at tp 2. The model: the
deepseek-tiny preset made smaller, YaRN on with an original context shorter than the sequence, and v_head_dim
different from the q/k width (the kernels' padding)."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from parity_helpers import assert_same_training, train_run
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology

MLA = {"preset": "deepseek-tiny", "n_layer": 3, "d_model": 32, "n_head": 4, "d_ff": 48, "vocab_size": 300,
       "kv_lora_rank": 16, "q_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
       "moe_d_ff": 16, "moe_bias_update_rate": 0.01, "rope_scaling": "yarn", "rope_factor": 4.0,
       "rope_original_positions": 8, "rope_mscale_all_dim": 0.8, "dropout": 0.0, "attn_dropout": 0.0}
STEPS = 3


def _res(parallel: dict, grad_accum: int, model: dict | None = None, zero: int = 1, train: dict | None = None):
    return tiny_resolved(model={**MLA, **(model or {})}, parallel=parallel, zero={"stage": zero},
                         train={"steps": STEPS, "micro_batch": 2, "grad_accum": grad_accum, "eval_batches": 1,
                                "seq_len": 16, **(train or {})})


def _run(parallel: dict, grad_accum: int, model: dict | None = None, **more):
    res = _res(parallel, grad_accum, model, **more)
    return run_distributed(lambda: train_run(res, Topology.of(res.recipe.parallel)), res.world_size)


@pytest.fixture(scope="module")
def reference():
    return train_run(_res({}, 4), Topology.solo())


def _check(outs, ref):
    biases = [n for n in ref["params"] if n.endswith("router.expert_bias")]
    assert biases and all(ref["params"][n].abs().max() > 0 for n in biases)  # the bias moved
    for got in outs:
        assert_same_training(got, ref)
        for name in biases:
            torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("parallel, grad_accum", [
    ({"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}, 2),
    ({"dp": 2, "pp": 2, "ep": 2}, 2),
    ({"cp": 2}, 4),
    ({"cp": 2, "cp_attention": "ring"}, 4),
])
def test_mla_layouts_equal_one_process(reference, parallel, grad_accum):
    _check(_run(parallel, grad_accum), reference)


def test_mla_zero3_with_activation_checkpointing(reference):
    """dp 2 x ep 2 with ZeRO-3 over the expert-data-parallel group and every block recomputed in backward."""
    _check(_run({"dp": 2, "ep": 2}, 2, zero=3, train={"activation_checkpointing": True}), reference)


def test_mla_without_q_compression_at_tp2():
    plain_q = {"q_lora_rank": 0}
    _check(_run({"tp": 2}, 4, plain_q), train_run(_res({}, 4, plain_q), Topology.solo()))


def test_resolver_takes_packing_with_latent_attention_and_refuses_it_with_mtp(monkeypatch):
    """Packed rows run on latent attention (tests/models/test_sft_packing.py holds them to the examples one by
    one); multi-token prediction's shifted targets would cross examples: refused before any process starts."""
    from megazoo.recipes import sft_check
    from megazoo.recipes.config import RecipeError

    monkeypatch.setattr(sft_check, "_manifest", lambda key, prefix: {"seq_len": 8, "vocab_size": 10})
    assert tiny_resolved(model=MLA, sft={"path": "stand-in", "packing": True}).model.mla
    with pytest.raises(RecipeError, match=r"sft.packing = true with multi-token prediction \(model.mtp_depth = 1\) "
                                          r"is not supported; valid: model.mtp_depth = 0"):
        tiny_resolved(model={**MLA, "mtp_depth": 1}, sft={"path": "stand-in", "packing": True})
