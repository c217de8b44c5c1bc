"""Decoding with a KV cache computes what a full recompute computes, at tp = 1 and 2 (fp64, 1e-10).

- KV-cache logits (prompt, then one position at a time, then a 3-position chunk) == full-sequence logits;
- greedy decode == the argmax loop over the full sequence without a cache (also past the context, where the
  window slides), and the trainer's closing sample (recipes/training/sample.py) is that same decode;
- sampling settings: top-k / top-p restrict the draw; bad values are refused;
- tp = 2 gives the same logits and the same tokens as tp = 1.
"""

import pytest
import torch
from harness import run_distributed

from megazoo.models.presets import get_preset
from megazoo.models.generation.generate import check_sampling, decode, full_logits, pick
from megazoo.models.generation.kv_cache import KVCache
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology
from megazoo.recipes.training.sample import generate

CFG = get_preset("gpt2-tiny").replace(vocab_size=97, dropout=0.0, attn_dropout=0.0, n_layer=2, n_positions=24)
SEQ = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))


def _model(topo):
    model = GPT(CFG, topo, dtype=torch.float64)
    init_weights(model, 11)
    return model.eval()


def _cached_vs_full(topo):
    model = _model(topo)
    with torch.no_grad():
        full = full_logits(model, SEQ)
        cache = KVCache(CFG.n_positions)
        pieces = [full_logits(model, SEQ[:, :8], cache)]  # the prompt fills the cache
        for t in range(8, 16):  # one position at a time
            pieces.append(full_logits(model, SEQ[:, t:t + 1], cache))
        pieces.append(full_logits(model, SEQ[:, 16:20], cache))  # a chunk after a past
        assert cache.length == 20
        greedy = decode(model, SEQ[0, :5].tolist(), 30, temperature=0.0)  # slides past n_positions = 24
    return full, torch.cat(pieces, dim=1), greedy


def _argmax_without_cache(model, prompt, new):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            window = torch.tensor([ids[-CFG.n_positions:]])
            ids.append(int(full_logits(model, window)[0, -1].argmax()))
    return ids


def test_cache_logits_equal_full_recompute_solo():
    full, cached, greedy = _cached_vs_full(Topology.solo())
    assert full.dtype == torch.float64
    assert (cached - full).abs().max().item() < 1e-10
    assert greedy == _argmax_without_cache(_model(Topology.solo()), SEQ[0, :5].tolist(), 30)
    assert len(greedy) == 35


def test_cache_logits_and_tokens_at_tp2_equal_solo():
    solo_full, _, solo_greedy = _cached_vs_full(Topology.solo())
    results = run_distributed(lambda: _cached_vs_full(Topology.build(dp=1, tp=2)), 2)
    for full, cached, greedy in results:
        assert (cached - full).abs().max().item() < 1e-10
        assert (full - solo_full).abs().max().item() < 1e-10
        assert greedy == solo_greedy


def test_cache_refuses_overflow_and_the_training_path_is_unchanged():
    model = _model(Topology.solo())
    cache = KVCache(CFG.n_positions)
    with torch.no_grad():
        model(SEQ[:, :20], cache=cache)
        with pytest.raises(ValueError, match="exceeds model.n_positions"):
            model(SEQ[:, :5], cache=cache)
    model.train()
    loss = model.loss(model(SEQ[:, :-1]), SEQ[:, 1:])  # no cache: gradients flow as before
    loss.backward()
    assert model.h["0"].attn.c_attn.weight.grad is not None


def test_trainer_sample_is_the_cached_decode_and_stops_only_where_asked():
    model = _model(Topology.solo())
    prompt = SEQ[1, :4].tolist()
    sampled = generate(model, prompt, 12, temperature=0.8, top_k=40, seed=5)
    assert sampled == decode(model, prompt, 12, temperature=0.8, top_k=40, seed=5)
    assert sampled[:4] == prompt and len(sampled) == 16
    assert sampled == generate(model, prompt, 12, temperature=0.8, top_k=40, seed=5)  # seeded
    stop_at = sampled[6]
    stopped = decode(model, prompt, 12, temperature=0.8, top_k=40, seed=5, stop=lambda new: new[-1] == stop_at)
    assert stopped == sampled[:sampled.index(stop_at, 4) + 1]


def test_top_k_and_top_p_restrict_the_draw():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    draw = torch.Generator().manual_seed(0)
    top1 = {int(pick(logits, temperature=1.0, top_k=1, top_p=1.0, draw=draw)) for _ in range(20)}
    assert top1 == {0}
    probs = logits.softmax(-1)[0]  # 0.636, 0.234, 0.086, ...: top_p 0.8 keeps ids 0 and 1 only
    assert probs[0] < 0.8 < probs[0] + probs[1]
    nucleus = {int(pick(logits, temperature=1.0, top_k=0, top_p=0.8, draw=draw)) for _ in range(200)}
    assert nucleus == {0, 1}
    anything = {int(pick(logits, temperature=1.0, top_k=0, top_p=1.0, draw=draw)) for _ in range(400)}
    assert len(anything) >= 4
    assert int(pick(logits, temperature=0.0, top_k=0, top_p=1.0, draw=draw)) == 0


@pytest.mark.parametrize("kwargs, match", [(dict(temperature=-1.0, top_k=0, top_p=1.0), "temperature"),
                                           (dict(temperature=1.0, top_k=-2, top_p=1.0), "top_k"),
                                           (dict(temperature=1.0, top_k=0, top_p=0.0), "top_p"),
                                           (dict(temperature=1.0, top_k=0, top_p=1.5), "top_p")])
def test_bad_sampling_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_sampling(**kwargs)


def test_decoding_refuses_what_the_cache_cannot_attend():
    from types import SimpleNamespace

    from megazoo.models.generation.generate import check_decodable

    for attention, cp in (("sparse", 1), ("dense", 2)):
        fake = SimpleNamespace(cfg=SimpleNamespace(attention=attention), topo=SimpleNamespace(cp=cp))
        with pytest.raises(ValueError, match="dense attention at cp = 1"):
            check_decodable(fake)
    check_decodable(_model(Topology.solo()))
