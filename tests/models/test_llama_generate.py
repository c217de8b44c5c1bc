"""KV-cache decoding of the Llama-style decoder (grouped-query attention, rotary positions past the cache,
sliding window) computes what a full recompute computes, in one process and at tp = 2 (key/value heads split)
and tp = 4 (replicated), fp64 to 1e-10. The cache holds the key/value heads, not their per-query repeats."""

import torch
from harness import run_distributed

from megazoo.models.presets import get_preset
from megazoo.models.generation.generate import decode, full_logits
from megazoo.models.generation.kv_cache import KVCache
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology

CFG = get_preset("llama-tiny").replace(vocab_size=97, n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=96,
                                        n_positions=24, sliding_window=6, rope_scaling="llama3",
                                        rope_original_positions=8)
SEQ = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))


def _cached_vs_full(topo):
    model = GPT(CFG, topo, dtype=torch.float64)
    init_weights(model, 11)
    model.eval()
    with torch.no_grad():
        full = full_logits(model, SEQ)
        cache = KVCache(CFG.n_positions)
        pieces = [full_logits(model, SEQ[:, :8], cache)]  # a prompt longer than the window
        for t in range(8, 16):
            pieces.append(full_logits(model, SEQ[:, t:t + 1], cache))
        pieces.append(full_logits(model, SEQ[:, 16:20], cache))
        stored = cache._k[0].shape[1]  # key/value heads this rank caches
        greedy = decode(model, SEQ[0, :5].tolist(), 12, temperature=0.0)
    return full, torch.cat(pieces, dim=1), greedy, stored


def test_cache_equals_full_recompute_and_tp_equals_solo():
    solo_full, solo_cached, solo_greedy, stored = _cached_vs_full(Topology.solo())
    assert (solo_cached - solo_full).abs().max().item() < 1e-10 and stored == 2
    for tp, heads in ((2, 1), (4, 1)):
        for full, cached, greedy, stored in run_distributed(lambda t=tp: _cached_vs_full(Topology.build(dp=1, tp=t)),
                                                            tp):
            assert (cached - full).abs().max().item() < 1e-10
            assert (full - solo_full).abs().max().item() < 1e-10
            assert greedy == solo_greedy and stored == heads
