"""gloo's large all-gathers and reduce-scatters run as direct point-to-point exchanges (parallel/collectives.py):
the same results as gloo's own collectives, and ZeRO 1-3 through them trains exactly as the reference."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from recipe_helpers import tiny_resolved
from parity_helpers import assert_same_training, train_run
from parity_helpers import zero_run

from megazoo.parallel import collectives
from megazoo.parallel.collectives import CommLedger, Exchange, all_gather_flat, reduce_scatter_flat
from megazoo.parallel.topology import Topology


@pytest.fixture(scope="module")
def reference():
    return train_run(tiny_resolved(train={"micro_batch": 8}), Topology.solo())


def _both_ways(n: int):
    """Every rank: native gloo and exchange results for the same inputs, sync and async, in place too."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.randn(size * n, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, threshold in (("native", 1 << 62), ("exchange", 0)):
        with mock.patch.object(collectives, "P2P_MIN_BYTES", threshold):
            ledger = CommLedger()
            rs = torch.empty(n, dtype=torch.float64)
            work = reduce_scatter_flat(rs, x.clone(), dist.group.WORLD, async_op=True, ledger=ledger)
            kinds = {type(work) is Exchange}
            work.wait()
            gathered = torch.empty(size * n, dtype=torch.float64)
            all_gather_flat(gathered, rs, dist.group.WORLD, ledger=ledger)  # sync
            in_place = torch.zeros(size * n, dtype=torch.float64)
            in_place[rank * n:(rank + 1) * n] = rs
            work = all_gather_flat(in_place, in_place[rank * n:(rank + 1) * n], dist.group.WORLD, async_op=True)
            kinds.add(type(work) is Exchange)
            work.wait()
            out[name] = {"rs": rs, "ag": gathered, "in_place": in_place, "exchanged": kinds,
                         "ledger": dict(ledger.bytes)}
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_exchange_equals_gloo_collectives(size):
    n = 1000
    results = run_distributed(_both_ways, size, n)
    everyone = torch.stack([torch.randn(size * n, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
                            for r in range(size)])
    total = everyone.sum(0)  # the reference: summed in rank order
    for rank, got in enumerate(results):
        native, exchange = got["native"], got["exchange"]
        assert native["exchanged"] == {False} and exchange["exchanged"] == {True}
        torch.testing.assert_close(exchange["rs"], total[rank * n:(rank + 1) * n], rtol=1e-15, atol=0)
        # gloo sums 3 ranks in its own order: a few ulps of O(1) values apart, never more
        torch.testing.assert_close(exchange["rs"], native["rs"], rtol=0, atol=1e-15)
        if size == 2:  # a + b in either order: bit-identical
            assert torch.equal(exchange["rs"], native["rs"])
        for key in ("ag", "in_place"):
            assert torch.equal(exchange[key], torch.cat([r["exchange"]["rs"] for r in results]))
            assert torch.equal(native[key], torch.cat([r["native"]["rs"] for r in results]))
        assert exchange["ledger"] == native["ledger"]  # the same (N-1)/N bytes counted either way


@pytest.mark.parametrize("stage, parallel, train", [
    (1, {"dp": 2}, {"micro_batch": 2, "grad_accum": 2}),
    (2, {"dp": 2, "tp": 2}, {"micro_batch": 4}),
    (3, {"dp": 2}, {"micro_batch": 4}),
])
def test_zero_through_exchanges_equals_reference(reference, stage, parallel, train):
    with mock.patch.object(collectives, "P2P_MIN_BYTES", 0):  # the forked ranks inherit it: every message
        for got in zero_run(parallel, train, {"stage": stage}):
            assert_same_training(got, reference)
