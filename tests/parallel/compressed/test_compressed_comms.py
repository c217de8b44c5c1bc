"""Compressed communication (parallel/compressed/): the wire format and the two-stage compressed all-reduce,
held bit for bit to its sequential definition written out below in plain tensor ops (no packing)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

from megazoo.parallel.collectives import CommLedger
from megazoo.parallel.compressed.comms import compressed_all_reduce, padded_numel
from megazoo.parallel.compressed.packing import pack_signs, unpack_signs, wire_bytes


def test_pack_unpack_round_trip():
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    x[0, :8] = 0.0  # zero counts as positive (one bit carries no zero)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 8)  # 8 signs per byte
    signs = unpack_signs(packed, torch.float64)
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0).double())
    # most significant bit first: + - - - - - - + is 0b10000001
    assert pack_signs(torch.tensor([1.0, -1, -2, -3, -4, -5, -6, 7])).tolist() == [129]
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_signs(unpack_signs(every_byte.view(-1, 1), torch.float32)).view(-1), every_byte)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(12))


def _sign(x):
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def _scale(rows):  # one scale per row (chunk): its RMS
    return (torch.linalg.vector_norm(rows, dim=1, keepdim=True) / math.sqrt(rows.shape[1])).to(rows.dtype)


def sequential_compressed_all_reduce(xs, worker_errors, server_errors):
    """The definition, one process, every rank's buffers in lists (updated in place); returns the result."""
    world, n = len(xs), xs[0].numel()
    c = n // world
    sent = []  # sent[k]: rank k's compressed chunks, (world, c)
    for k in range(world):
        y = (xs[k] + worker_errors[k]).view(world, c)
        q = _sign(y) * _scale(y)
        worker_errors[k].copy_((y - q).view(-1))
        sent.append(q)
    result = torch.empty(n, dtype=xs[0].dtype)
    for r in range(world):  # server r: chunk r from every worker, in rank order
        z = torch.stack([sent[k][r] for k in range(world)]).sum(dim=0) / world + server_errors[r]
        t = _sign(z) * _scale(z.view(1, c)).view(())
        server_errors[r].copy_(z - t)
        result[r * c:(r + 1) * c] = t
    return result


def _random_inputs(world: int, n: int, rounds: int, dtype):
    g = torch.Generator().manual_seed(11)
    return [[torch.randn(n, generator=g, dtype=dtype) * (1 + r) for _ in range(world)] for r in range(rounds)]


def _distributed(world: int, n: int, rounds: int, dtype):
    rank = dist.get_rank()
    inputs = _random_inputs(world, n, rounds, dtype)
    worker_error, server_error = torch.zeros(n, dtype=dtype), torch.zeros(n // world, dtype=dtype)
    ledger, out = CommLedger(), []
    for xs in inputs:
        x = xs[rank].clone()
        compressed_all_reduce(x, worker_error, server_error, dist.group.WORLD, ledger=ledger)
        out.append(x)
    return out, worker_error, server_error, dict(ledger.bytes)


@pytest.mark.parametrize("world, dtype", [(2, torch.float32), (4, torch.float64)])
def test_compressed_all_reduce_equals_its_sequential_definition(world, dtype):
    n, rounds = padded_numel(1000, world), 3
    assert n % (8 * world) == 0 and n >= 1000
    results = run_distributed(_distributed, world, world, n, rounds, dtype)
    inputs = _random_inputs(world, n, rounds, dtype)
    worker_errors = [torch.zeros(n, dtype=dtype) for _ in range(world)]
    server_errors = [torch.zeros(n // world, dtype=dtype) for _ in range(world)]
    for i, xs in enumerate(inputs):  # several rounds: the error buffers feed back
        expected = sequential_compressed_all_reduce(xs, worker_errors, server_errors)
        for rank, (out, _, _, _) in enumerate(results):
            assert torch.equal(out[i], expected), (i, rank)
            assert len(torch.unique(expected.abs().view(world, -1), dim=1).view(-1)) == world  # one scale a chunk
    for rank, (_, worker_error, server_error, sent) in enumerate(results):
        assert torch.equal(worker_error, worker_errors[rank])
        assert torch.equal(server_error, server_errors[rank])
        assert worker_error.abs().sum() > 0 and server_error.abs().sum() > 0
        # per round: all-to-all of every chunk but one's own, all-gather of the rest's server chunks
        chunk = wire_bytes(n // world, dtype)
        assert sent == {"compressed_all_to_all": rounds * (world - 1) * chunk,
                        "compressed_all_gather": rounds * (world - 1) * chunk}


def test_one_rank_compresses_without_collectives():
    """A group of one (None) runs the same arithmetic: the sequential definition at N = 1."""
    x = torch.randn(64, dtype=torch.float64)
    we, se = torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    expected = sequential_compressed_all_reduce([x.clone()], [we.clone()], [se.clone()])
    assert torch.equal(compressed_all_reduce(x, we, se, None), expected)
    with pytest.raises(ValueError, match="multiple of 8"):
        compressed_all_reduce(torch.ones(12), torch.zeros(12), torch.zeros(12), None)
