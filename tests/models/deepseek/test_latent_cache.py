"""Decoding latent attention over the latent cache (models/generation/latent_cache.py, MLA._absorbed): only c_kv
and the rotated k_pe are cached and the key/value up-projection is absorbed into the query and the output; it
equals decoding with the full per-head key/value cache token for token (and step by step in logits, 1e-5 fp32)
and transformers' greedy generation, at tp 1 and tp 2, with and without q compression and YaRN; the cache holds
(kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes per token, which `megazoo generate --verbose` prints."""

from __future__ import annotations

import pytest
import torch

from deepseek_hf_helpers import IDS, hf_dir, hf_model
from harness import run_distributed
from hf_helpers import tiny_hf_tokenizer

from megazoo.models.generation.generate import decode, full_logits, new_cache
from megazoo.models.generation.kv_cache import KVCache
from megazoo.models.generation.latent_cache import LatentCache
from megazoo.models.hf.families import read_hf_dir
from megazoo.models.hf.gpt2 import gpt_from_full_state
from megazoo.parallel.topology import Topology
from megazoo.recipes.cli import main as megazoo

KINDS = ("qlora", "plain_q")
PROMPT = IDS[0, :6].tolist()


def _stepwise(model, cache) -> list[torch.Tensor]:
    """Logits of the prompt's last position, then of 5 single-token steps feeding fixed ids."""
    out = [full_logits(model, torch.tensor([PROMPT]), cache)[:, -1]]
    for token in IDS[1, :5].tolist():
        out.append(full_logits(model, torch.tensor([[token]]), cache)[:, -1])
    return out


def _both(topo: Topology, kind: str):
    cfg, full = read_hf_dir(hf_dir(kind))
    model = gpt_from_full_state(cfg, full, topo)
    with torch.no_grad():
        latent, reference = LatentCache(cfg.n_positions), KVCache(cfg.n_positions)
        steps = [(a, b) for a, b in zip(_stepwise(model, latent), _stepwise(model, reference))]
    tokens = decode(model, PROMPT, 12), decode(model, PROMPT, 12, cache=KVCache(cfg.n_positions))
    return steps, tokens, latent.bytes_per_token(), cfg


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp", [1, 2])
def test_latent_decode_equals_full_cache_decode(kind, tp):
    outs = [_both(Topology.solo(), kind)] if tp == 1 else \
        run_distributed(lambda: _both(Topology.build(dp=1, tp=2), kind), 2)
    theirs = hf_model(kind).generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                                     eos_token_id=None, min_new_tokens=12)[0].tolist()
    for steps, (latent, full), per_token, cfg in outs:
        for a, b in steps:
            assert (a - b).abs().max().item() < 1e-5
        assert latent == full == theirs and len(latent) == 18
        assert per_token == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.n_layer * 4  # fp32


def test_new_cache_is_latent_for_mla_only():
    cfg, _ = read_hf_dir(hf_dir("qlora"))
    assert isinstance(new_cache(cfg), LatentCache) and isinstance(new_cache(cfg.replace(
        kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0, n_experts=0,
        moe_router="softmax", moe_n_group=1, moe_topk_group=1, moe_routed_scaling_factor=1.0)), KVCache)


def test_generate_verbose_prints_latent_cache_bytes(capsys):
    hf = hf_dir("qlora")
    tiny_hf_tokenizer().save_pretrained(str(hf))
    assert megazoo(["generate", "--hf", str(hf), "--prompt", "hello", "--max-new-tokens", "3", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "cache bytes per token: 384 (latent cache: (kv_lora_rank 24 + qk_rope_head_dim 8) x 3 layers x 4 bytes)" \
        in err, err
