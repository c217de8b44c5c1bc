"""Self-speculative decoding with the MTP module (models/deepseek/speculative.py): the output equals plain greedy
decoding (models/generation/generate.py's decode) token for token, with drafts accepted (a model trained on a
cyclic sequence: most steps yield 2 tokens) and rejected (untrained MTP weights), at tp 1 and tp 2; what it does
not do is refused with a message naming the value."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

from megazoo.models.deepseek.speculative import speculative_decode
from megazoo.models.generation.generate import decode
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import full_state_dict, init_weights
from megazoo.parallel.topology import Topology

CFG = get_preset("llama-tiny").replace(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48, vocab_size=64,
                                       n_positions=64, dropout=0.0, attn_dropout=0.0, mtp_depth=1)
CYCLE = 11  # the training sequence: t_{i+1} = t_i + 3 mod 11 (offset by 5)


def _cyclic(start: int, n: int) -> list[int]:
    return [5 + (start + 3 * i) % CYCLE for i in range(n)]


def _trained() -> dict:
    torch.manual_seed(0)
    model = GPT(CFG, Topology.solo())
    init_weights(model, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for step in range(60):
        batch = torch.tensor([_cyclic(s, 33) for s in range(8)])
        loss = model.loss(model(batch[:, :-1]), batch[:, 1:], batch[:, :-1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return full_state_dict(model)


def _decode_both(state: dict | None, prompts: list[list[int]], n: int):
    topo = Topology.solo() if torch.distributed.get_world_size() == 1 else Topology.build(dp=1, tp=2)
    model = GPT(CFG, topo)
    init_weights(model, 1)
    if state is not None:  # this rank's shards of the trained full state
        from megazoo.parallel.tensor import named_shards
        from megazoo.parallel.tensor.shards import shard_of

        with torch.no_grad():
            for name, param, spec in named_shards(model):
                full = state[name]
                if name in ("wte.weight", "lm_head.weight"):
                    full = torch.cat([full, full.new_zeros(spec.global_shape[0] - full.shape[0], full.shape[1])])
                param.copy_(shard_of(full, spec))
    out = []
    for prompt in prompts:
        spec = speculative_decode(model, prompt, n)
        out.append((spec.ids, decode(model, prompt, n), spec.accepted))
    return out


@pytest.fixture(scope="module")
def trained():
    return _trained()


PROMPTS = [_cyclic(2, 6), [7, 9, 30, 41, 5]]


@pytest.mark.parametrize("tp", [1, 2])
def test_accepted_drafts_give_plain_greedy_tokens(trained, tp):
    for rank in run_distributed(_decode_both, tp, trained, PROMPTS, 20):
        for prompt, (spec, plain, accepted) in zip(PROMPTS, rank):
            assert spec == plain and len(spec) == len(prompt) + 20
            # the prompt's forward gives 1 token, each later one 1 + accepted (the last may stop at the limit)
            assert 1 + len(accepted) + sum(accepted) in (20, 21)
        assert sum(rank[0][2]) >= 0.8 * len(rank[0][2])  # the trained draft: mostly 2 tokens per forward


def test_rejected_drafts_give_plain_greedy_tokens():
    for spec, plain, accepted in run_distributed(_decode_both, 1, None, PROMPTS, 12)[0]:
        assert spec == plain
        assert 0 in accepted  # untrained MTP weights: drafts rejected, the cache rolled back


def test_refusals():
    model = GPT(CFG.replace(mtp_depth=0), Topology.solo())
    with pytest.raises(ValueError, match="model.mtp_depth = 0; valid: a model trained with mtp_depth >= 1"):
        speculative_decode(model, [1, 2], 4)
    model = GPT(CFG, Topology.solo())
    with pytest.raises(ValueError, match=r"\+ 1 exceeds model.n_positions = 64; valid: --max-new-tokens <= 61"):
        speculative_decode(model, [1, 2], 62)
