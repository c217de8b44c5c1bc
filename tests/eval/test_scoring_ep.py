"""What ep > 1 changes in scoring and decoding (eval/scoring.gpt_forward, models/generation/generate.decode), on a
tiny Mixtral in fp64 at ep 2 (and tp 2 x ep 2) against the same weights in one process:

  * a scoring forward's rows are split over the ep ranks (ceil(b / ep) each, the last row repeated to fill) and
    the logits all-gathered: equal to ep 1 on every rank, with each rank running only its share; with a capacity
    factor (it caps an expert's rows per rank) every rank runs every row, still equal to ep 1;
  * the ep ranks' counted FLOPs of a batch add up to one process's (the work is split, not repeated);
  * decoding: the token the first ep rank picks is the one every rank continues with, even where another rank's
    logits would pick another.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

from megazoo.eval.scoring import gpt_logits_fn
from megazoo.models.generation.generate import decode
from megazoo.models.hf.gpt2 import gpt_from_full_state
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import full_state_dict, init_weights
from megazoo.parallel.topology import Topology

CFG = get_preset("mixtral-tiny").replace(n_layer=2, vocab_size=96, n_positions=32, dropout=0.0, attn_dropout=0.0)
IDS = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(0))


def _weights(cfg) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg, Topology.solo(), dtype=torch.float64)
    init_weights(model, 3)
    return full_state_dict(model)


def _rows_seen(model) -> list[int]:
    seen: list[int] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("tp, capacity, rows", [(1, 0.0, 2), (2, 0.0, 2), (1, 4.0, 3)])
def test_scoring_at_ep2_splits_the_rows_and_equals_ep1(tp, capacity, rows):
    cfg = CFG.replace(moe_capacity_factor=capacity)
    full = _weights(cfg)
    reference = gpt_logits_fn(gpt_from_full_state(cfg, full, Topology.solo(), torch.float64))(IDS)

    def ranks():
        model = gpt_from_full_state(cfg, full, Topology.build(dp=2, tp=tp, ep=2), torch.float64)
        seen = _rows_seen(model)
        return gpt_logits_fn(model)(IDS), seen

    for logits, seen in run_distributed(ranks, 2 * tp):
        assert seen == [rows]  # dropless: 2 of the 3 rows here (ep rank 1: row 2 and row 2 again); else all 3
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-12)


def test_decoding_at_ep2_continues_with_the_first_ranks_token():
    full = _weights(CFG)
    prompt = IDS[0, :5].tolist()
    reference = decode(gpt_from_full_state(CFG, full, Topology.solo(), torch.float64), prompt, 6)

    def ranks():
        import megazoo.models.generation.generate as generation

        topo = Topology.build(dp=2, tp=1, ep=2)
        model = gpt_from_full_state(CFG, full, topo, torch.float64)
        if topo.ep_rank == 1:  # this rank's logits would pick token 7 at every step
            real = generation.full_logits

            def other(model, ids, cache=None):
                logits = real(model, ids, cache)
                logits[..., 7] = 1e9
                return logits

            generation.full_logits = other
        return decode(model, prompt, 6)

    assert reference[5:] != [7] * 6
    assert run_distributed(ranks, 2) == [reference, reference]


def test_the_ep_ranks_flops_add_up_to_one_process():
    """The work is split, not repeated: counted FLOPs (torch's counter, the grouped matmul's formula included) of
    one scoring batch (8 x 32 tokens) on the two ep ranks add up to one process's exactly."""
    from megazoo.parallel.simulation.fake_world import flop_counter

    full, ids = _weights(CFG), torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(1))

    def flops(topo) -> int:
        logits_fn = gpt_logits_fn(gpt_from_full_state(CFG, full, topo))
        with flop_counter() as counter:
            logits_fn(ids)
        return counter.get_total_flops()

    one = flops(Topology.solo())
    per_rank = run_distributed(lambda: flops(Topology.build(dp=2, tp=1, ep=2)), 2)
    assert sum(per_rank) == one and max(per_rank) < 0.6 * one, (per_rank, one)
