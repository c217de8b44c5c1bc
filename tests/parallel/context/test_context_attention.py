"""Context-parallel attention (parallel/context) equals dense causal attention over the whole sequence.

Every rank builds the same whole-sequence q, k, v and output gradient (fp64), keeps its load-balanced chunks,
runs all-to-all (Ulysses) and ring attention over the cp group and backpropagates; the parent reassembles the
ranks' outputs and dq / dk / dv and holds them to the dense single-process result (1e-10).
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

from megazoo.kernels.attention import attention_reference, attention_sdpa
from megazoo.parallel.context import (attention_comm_bytes, chunk_ids, context_attention, gathered_positions,
                                      positions, ring_attention, split_sequence)

B, S, HD = 2, 24, 8
TOL = 1e-10


def _inputs(heads: int):
    g = torch.Generator().manual_seed(heads)
    q, k, v, dy = (torch.randn(B, heads, S, HD, generator=g, dtype=torch.float64) for _ in range(4))
    return q, k, v, dy


def _dense(heads: int):
    q, k, v, dy = _inputs(heads)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = attention_reference(q, k, v)
    y.backward(dy)
    return y.detach(), q.grad, k.grad, v.grad


def _on_cp_rank(cp: int, heads_by_algorithm: dict[str, int]):
    """(output, dq, dk, dv) of this rank's chunks for each algorithm."""
    import torch.distributed as dist
    rank = dist.get_rank()
    group = dist.new_group(list(range(cp)))
    out = {}
    for algorithm, heads in heads_by_algorithm.items():
        q, k, v, dy = (split_sequence(t, cp, rank, dim=2) for t in _inputs(heads))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        if algorithm == "ring_tiled":  # tiles of 2 rows: partial tiles, several per chunk, diagonal ones
            y = ring_attention(q, k, v, group, tile=2)
        else:
            y = context_attention(attention_sdpa, group, algorithm)(q, k, v, 0.0)
        y.backward(dy)
        out[algorithm] = (y.detach(), q.grad, k.grad, v.grad)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_context_attention_equals_dense(cp):
    heads = {"all_to_all": 4, "ring": 3, "ring_tiled": 2}  # ring: any head count (3 is not divisible by cp)
    results = run_distributed(_on_cp_rank, cp, cp, heads)
    for algorithm, h in heads.items():
        for name, want in zip(("output", "dq", "dk", "dv"), _dense(h)):
            for rank, got in enumerate(results):
                torch.testing.assert_close(got[algorithm][("output", "dq", "dk", "dv").index(name)],
                                           split_sequence(want, cp, rank, dim=2), rtol=0, atol=TOL,
                                           msg=f"{algorithm} cp={cp} rank {rank} {name}")


def test_single_rank_is_plain_attention():
    q, k, v, _ = _inputs(2)
    assert context_attention(attention_sdpa, None, "ring") is attention_sdpa
    torch.testing.assert_close(ring_attention(q, k, v, None), attention_reference(q, k, v), rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="parallel.cp_attention = 'zigzag' is invalid; valid: all_to_all, ring"):
        context_attention(attention_sdpa, None, "zigzag")


def test_load_balanced_split():
    cp, s = 4, 16  # 8 chunks of 2
    assert [chunk_ids(cp, r) for r in range(cp)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = torch.arange(s).view(1, s)
    for r in range(cp):
        assert torch.equal(split_sequence(x, cp, r)[0], positions(s // cp, cp, r))
    assert torch.equal(positions(4, cp, 1), torch.tensor([2, 3, 12, 13]))
    assert sorted(gathered_positions(s // cp, cp).tolist()) == list(range(s))
    # Even causal work: rank r's query rows see (sum of positions + 1) keys; every rank the same.
    work = [int((positions(s // cp, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by 2 x cp = 8"):
        split_sequence(torch.zeros(1, 12), cp, 0)


def _ulysses_bad_heads():
    import torch.distributed as dist
    group = dist.new_group([0, 1])
    q = torch.zeros(1, 3, 4, 2, dtype=torch.float64)
    try:
        context_attention(attention_sdpa, group, "all_to_all")(q, q, q, 0.0)
    except ValueError as err:
        return str(err)
    return "no error"


def test_all_to_all_refuses_indivisible_heads():
    for message in run_distributed(_ulysses_bad_heads, 2):
        assert "local head count (3) divisible by cp = 2" in message



def _counted_bytes(cp: int, heads: int):
    """Bytes this rank sends in forward and in backward, counted at the torch.distributed calls."""
    import torch.distributed as dist
    rank, group = dist.get_rank(), dist.new_group(list(range(cp)))
    sent = {"n": 0}
    a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

    def counting_a2a(out, inp, *args, **kwargs):
        sent["n"] += inp.numel() * inp.element_size() * (cp - 1) / cp  # its own piece stays here
        return a2a(out, inp, *args, **kwargs)

    def counting_batch(ops):
        sent["n"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = counting_a2a, counting_batch
    out = {}
    for algorithm in ("all_to_all", "ring"):
        q, k, v, dy = (split_sequence(t, cp, rank, dim=2).requires_grad_() for t in _inputs(heads))
        sent["n"] = 0
        y = context_attention(attention_sdpa, group, algorithm)(q, k, v, 0.0)
        forward = sent["n"]
        y.backward(dy)
        out[algorithm] = {"forward": forward, "backward": sent["n"] - forward}
    return out


def test_communication_volume_matches_the_formula():
    cp, heads = 4, 4
    for counted in run_distributed(_counted_bytes, cp, cp, heads):
        for algorithm in ("all_to_all", "ring"):
            assert counted[algorithm] == attention_comm_bytes(algorithm, cp, B, heads, S, HD, 8), algorithm


def test_the_dry_run_rings_in_fewer_larger_tiles():
    """Under fake tensors (the dry run) a rank's rows go in at most FAKE_TILES_PER_RANK tiles (long-context.toml's
    4,096 local rows: 512-row tiles, not 32 of 128); real tensors keep the tile they are given."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megazoo.parallel.context.attention import FAKE_TILES_PER_RANK, TILE, _tile_for

    assert _tile_for(torch.zeros(1, 2, 4096, 8), TILE) == TILE
    with FakeTensorMode():
        fake = torch.empty(1, 2, 4096, 8)
        assert _tile_for(fake, TILE) == 4096 // FAKE_TILES_PER_RANK == 512
        assert _tile_for(torch.empty(1, 2, 256, 8), TILE) == TILE  # short sequences: the tile as given
