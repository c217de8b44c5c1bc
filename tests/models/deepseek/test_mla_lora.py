"""LoRA on latent attention (models/lora: targets q -> q_b or c_q, kv -> kv_b, o -> c_proj): held to Hugging Face
PEFT on transformers' DeepseekV3ForCausalLM (deepseek_hf_helpers: with and without q compression), logits and
every adapter's gradient to 1e-5 in fp32 at tp 1 and tp 2, the adapters read from and written to PEFT's format
(q's lora_B rows in DeepSeek's interleaved rotary order); the merged weights give the unmerged model's logits; the
latent cache decodes an unmerged kv adapter as the full cache does; and what stays refused says what is valid."""

from __future__ import annotations

import copy
import functools

import peft
import pytest
import torch
from deepseek_hf_helpers import IDS, V, hf_dir, hf_model
from harness import run_distributed
from lora_helpers import adapted_step, next_token_loss

from megazoo.models.generation.generate import full_logits
from megazoo.models.generation.kv_cache import KVCache
from megazoo.models.generation.latent_cache import LatentCache
from megazoo.models.hf.families import read_hf_dir
from megazoo.models.hf.gpt2 import gpt_from_full_state, load_full_state_into
from megazoo.models.lora.adapters import attach_lora, merge_lora
from megazoo.models.lora.config import LoRAConfig, adapter_parameters, check_lora
from megazoo.models.lora.peft_interop import from_peft_config, from_peft_state, key_pairs, peft_config, to_peft_state
from megazoo.models.transformer import GPT
from megazoo.parallel.topology import Topology

KINDS = ("qlora", "plain_q")
TOL = dict(atol=1e-5, rtol=1e-5)


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return next_token_loss(logits, IDS)


@functools.lru_cache(maxsize=None)
def reference(kind: str):
    """(our cfg, base full state, LoRA settings, adapters by our names, PEFT logits, PEFT grads by our names)."""
    cfg, base = read_hf_dir(hf_dir(kind))
    q = "q_b_proj" if kind == "qlora" else "q_proj"
    settings = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[q, "kv_b_proj", "o_proj"],
                               init_lora_weights=False)  # B random too
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(copy.deepcopy(hf_model(kind)), settings).eval()
    lora = from_peft_config(settings.to_dict(), cfg)
    adapters = from_peft_state(peft.get_peft_model_state_dict(peft_model), cfg, lora)
    logits = peft_model(IDS).logits
    loss_of(logits).backward()
    grads = {key: p.grad.clone() for key, p in ((k.replace(".default.", "."), p)
                                                 for k, p in peft_model.named_parameters()) if p.grad is not None}
    return cfg, base, lora, adapters, logits.detach(), from_peft_state(grads, cfg, lora)


def ours(topo: Topology, kind: str):
    cfg, base, lora, adapters, _, _ = reference(kind)
    logits, grads, _, trained = adapted_step(topo, cfg, base, lora, adapters, IDS, V)
    return logits, grads, trained


def _check(kind: str, outcome, tp: int) -> None:
    cfg, _, lora, _, peft_logits, peft_grads = reference(kind)
    logits, grads, trained = outcome
    torch.testing.assert_close(logits, peft_logits, **TOL)
    assert set(grads) == set(peft_grads) == {ours for ours, _ in key_pairs(cfg, lora)}
    for name in grads:
        torch.testing.assert_close(grads[name], peft_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert all(g.abs().max() > 1e-4 for g in grads.values())  # the comparison is not of zeros
    assert trained == cfg.n_layer * adapter_parameters(cfg, lora, tp)  # the planner's count: this rank's adapters


@pytest.mark.parametrize("kind", KINDS)
def test_lora_on_latent_attention_equals_peft_at_tp1(kind):
    _check(kind, ours(Topology.solo(), kind), 1)


def test_lora_on_latent_attention_equals_peft_at_tp2():
    reference("qlora")  # built once in the parent, inherited by the forked ranks
    for outcome in run_distributed(lambda: ours(Topology.build(dp=1, tp=2), "qlora"), 2):
        _check("qlora", outcome, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_peft_files_both_ways_and_the_merge(kind):
    cfg, base, lora, adapters, peft_logits, _ = reference(kind)
    assert lora.targets == ("q", "kv", "o") and from_peft_config(peft_config(cfg, lora), cfg) == lora
    written = to_peft_state({**base, **adapters}, cfg, lora)
    if kind == "qlora":  # q's B goes back to HF's interleaved rotary rows: not the tensor we hold
        ours_q_b, q_b = next((o, p) for o, p in key_pairs(cfg, lora) if "q_b_proj.lora_B" in p)
        assert not torch.equal(written[q_b], adapters[ours_q_b])
    back = from_peft_state(written, cfg, lora)
    assert all(torch.equal(back[k], adapters[k]) for k in adapters)
    merged = gpt_from_full_state(cfg, merge_lora({**base, **adapters}, cfg, lora), Topology.solo())
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS)[..., :V], peft_logits, **TOL)


def test_latent_cache_decodes_an_unmerged_kv_adapter_as_the_full_cache():
    cfg, base, lora, adapters, _, _ = reference("qlora")
    model = GPT(cfg, Topology.solo())
    attach_lora(model, lora)
    load_full_state_into(model, {**base, **adapters})
    model.eval()
    prompt = torch.tensor([IDS[0, :6].tolist()])
    with torch.no_grad():
        latent, full = LatentCache(cfg.n_positions), KVCache(cfg.n_positions)
        a, b = full_logits(model, prompt, latent)[:, -1], full_logits(model, prompt, full)[:, -1]
        a2, b2 = (full_logits(model, IDS[1:, :1], c)[:, -1] for c in (latent, full))
    assert (a - b).abs().max().item() < 1e-5 and (a2 - b2).abs().max().item() < 1e-5


def test_what_latent_attention_refuses_names_what_is_valid():
    cfg = reference("qlora")[0]
    with pytest.raises(ValueError, match=r"lora.targets = \['q', 'v'\] is invalid for model .*: give each at most "
                                         r"once, from \['q', 'kv', 'o', 'gate', 'up', 'down'\]"):
        check_lora(LoRAConfig(rank=4), cfg)  # the default targets name Llama's v, which MLA does not have
    with pytest.raises(ValueError, match=r"lora.targets \['up'\] on model .*which has 8 experts"):
        check_lora(LoRAConfig(rank=4, targets=("q", "up")), cfg)
