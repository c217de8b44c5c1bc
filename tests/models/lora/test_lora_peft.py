"""LoRA on megazoo's tensor-parallel layers equals Hugging Face PEFT's LoRA on the same HF model with the same
adapter weights: logits and every adapter gradient to 1e-5 in fp32, at tp = 1 and tp = 2 (forked gloo ranks), for
GPT-2 (PEFT on the fused Conv1D c_attn, c_proj, c_fc) and a grouped-query Llama (q/k/v/o, gate/up/down: our fused
c_kv and [gate; up] layers carry one adapter per section). Tiny configs, random weights, no download."""

from __future__ import annotations

import functools

import peft
import pytest
import torch
import transformers
from harness import run_distributed
from lora_helpers import adapted_step, next_token_loss

from megazoo.models.hf import gpt2 as gpt2_hf
from megazoo.models.hf import llama as llama_hf
from megazoo.models.lora.peft_interop import from_peft_config, from_peft_state, key_pairs, peft_config
from megazoo.parallel.topology import Topology

V = 300
TOL = dict(atol=1e-5, rtol=1e-5)
IDS = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
FAMILIES = {
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             gpt2_hf, ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),
    "llama": (lambda: transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                               tie_word_embeddings=False),
              llama_hf, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]),
}


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return next_token_loss(logits, IDS)


@functools.lru_cache(maxsize=None)
def reference(family: str):
    """(our cfg, base full state, LoRA settings, adapter full state, PEFT logits, PEFT adapter grads by our name)."""
    make_config, hf, modules = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(), attn_implementation="eager")
    cfg = hf.config_from_hf(model.config, name=f"tiny-{family}")
    base = hf.hf_to_megazoo_state({k: v.clone() for k, v in model.state_dict().items()}, cfg)
    settings = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=modules,
                               fan_in_fan_out=family == "gpt2", init_lora_weights=False)  # B random too
    peft_model = peft.get_peft_model(model, settings).eval()
    lora = from_peft_config(settings.to_dict(), cfg)
    adapters = from_peft_state(peft.get_peft_model_state_dict(peft_model), cfg, lora)
    logits = peft_model(IDS).logits
    loss_of(logits).backward()
    params = dict(peft_model.named_parameters())
    grads = {ours: params[key.replace(".weight", ".default.weight")].grad.clone() for ours, key in key_pairs(cfg, lora)}
    return cfg, base, lora, adapters, logits.detach(), grads


def ours(topo: Topology, family: str):
    cfg, base, lora, adapters, _, _ = reference(family)
    return adapted_step(topo, cfg, base, lora, adapters, IDS, V)[:3]


def _check(family: str, outcome) -> None:
    _, _, _, _, peft_logits, peft_grads = reference(family)
    logits, grads, frozen_grads = outcome
    assert not frozen_grads
    torch.testing.assert_close(logits, peft_logits, **TOL)
    assert set(grads) == set(peft_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], peft_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert any(g.abs().max() > 1e-3 for g in grads.values())  # the comparison is not of zeros


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_equals_peft_at_tp1(family):
    _check(family, ours(Topology.solo(), family))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_equals_peft_at_tp2(family):
    reference(family)  # built once in the parent, inherited by the forked ranks
    results = run_distributed(lambda f: ours(Topology.build(dp=1, tp=2), f), 2, family)
    for outcome in results:
        _check(family, outcome)


def test_peft_config_round_trip():
    cfg, _, lora, _, _, _ = reference("llama")
    assert from_peft_config(peft_config(cfg, lora), cfg) == lora
    assert lora.targets == ("q", "k", "v", "o", "gate", "up", "down")
