"""Tensor-parallel communication, shard bookkeeping and random streams against single-process references.

The four comm autograd functions (forward and backward), ShardSpec's gather/shard round trip and the tp RNG
tracker, on tp = 2 and 4 forked gloo ranks (helpers shared with tests/parallel/tensor/test_tensor_layers.py).
"""

import pytest
import torch
from tensor_helpers import B, S, TOL, TPS, on_tp, own_columns, randn

from megazoo.parallel.tensor import (ShardSpec, TPRNGTracker, copy_to_tp_region, gather_from_tp_region, gather_full,
                                     reduce_from_tp_region, scatter_to_tp_region, shard_of)
from megazoo.parallel.tensor.random import seed_default_stream


# --- the four comm functions ----------------------------------------------------------------------------------

WIDTH = 8  # last dim, divisible by every tp


@pytest.mark.parametrize("tp", TPS)
def test_comm_functions_forward_and_backward(tp):
    xs, gs = randn(tp, B, S, WIDTH, seed=51), randn(tp, B, S, WIDTH, seed=52)  # rank r's input / upstream grad
    part = WIDTH // tp

    def work(topo):
        r, group = topo.tp_rank, topo.tp_group
        out = {}
        # copy_to_tp_region: forward identity, backward all-reduce (sum) of the upstream gradients.
        x = xs[r].clone().requires_grad_()
        upstream = gs[r].clone()
        y = copy_to_tp_region(x, group)
        y.backward(upstream)
        out["copy"] = (y.detach(), x.grad, torch.equal(upstream, gs[r]))
        # reduce_from_tp_region: forward all-reduce (sum), backward identity; the input is not modified.
        x = xs[r].clone().requires_grad_()
        y = reduce_from_tp_region(x, group)
        y.backward(gs[r])
        out["reduce"] = (y.detach(), x.grad, torch.equal(x.detach(), xs[r]))
        # scatter_to_tp_region: forward keeps this rank's chunk of the last dim, backward all-gathers the grads.
        x = xs[0].clone().requires_grad_()  # a replicated input
        y = scatter_to_tp_region(x, group)
        y.backward(gs[r][..., :part])
        out["scatter"] = (y.detach(), x.grad)
        # gather_from_tp_region: forward all-gathers the last dim, backward keeps this rank's chunk of the grad.
        x = xs[r][..., :part].clone().requires_grad_()
        y = gather_from_tp_region(x, group)
        y.backward(gs[r])
        out["gather"] = (y.detach(), x.grad)
        with pytest.raises(ValueError, match="not divisible"):
            scatter_to_tp_region(torch.zeros(2, tp + 1), group)
        return out

    grad_sum = gs.sum(0)
    for r, out in enumerate(on_tp(tp, work)):
        y, dx, upstream_untouched = out["copy"]
        assert torch.equal(y, xs[r])
        torch.testing.assert_close(dx, grad_sum, **TOL)
        assert upstream_untouched, "copy_to_tp_region's backward must not all-reduce the upstream grad in place"

        y, dx, input_untouched = out["reduce"]
        torch.testing.assert_close(y, xs.sum(0), **TOL)
        assert torch.equal(dx, gs[r]) and input_untouched

        y, dx = out["scatter"]
        assert torch.equal(y, xs[0][..., r * part:(r + 1) * part])
        assert torch.equal(dx, torch.cat([gs[q][..., :part] for q in range(tp)], dim=-1))

        y, dx = out["gather"]
        assert torch.equal(y, torch.cat([xs[q][..., :part] for q in range(tp)], dim=-1))
        assert torch.equal(dx, gs[r][..., r * part:(r + 1) * part])


def test_comm_functions_are_identity_without_group():
    x = randn(2, 3, seed=53)
    for fn in (copy_to_tp_region, reduce_from_tp_region, scatter_to_tp_region, gather_from_tp_region):
        assert fn(x, None) is x


# --- shard_of / gather_full -----------------------------------------------------------------------------------

ROUND_TRIP_LAYOUTS = [((24, 5), 0, 1), ((24, 5), 0, 3), ((5, 24), 1, 1), ((5, 24), 1, 3), ((24,), 0, 3),
                      ((24, 5), None, 1)]


@pytest.mark.parametrize("tp", TPS)
def test_gather_full_inverts_shard_of(tp):
    fulls = [randn(*shape, seed=60 + i) for i, (shape, _, _) in enumerate(ROUND_TRIP_LAYOUTS)]

    def work(topo):
        results = []
        for full, (shape, dim, sections) in zip(fulls, ROUND_TRIP_LAYOUTS):
            size = 1 if dim is None else tp
            spec = ShardSpec(shape, dim, sections, topo.tp_rank if dim is not None else 0, size)
            local = shard_of(full, spec)
            results.append((tuple(local.shape), spec.local_shape, local, gather_full(local, spec, topo.tp_group)))
        return results

    for r, results in enumerate(on_tp(tp, work)):
        for full, (shape, dim, sections), (local_shape, spec_shape, local, back) in zip(fulls, ROUND_TRIP_LAYOUTS,
                                                                                       results):
            assert local_shape == spec_shape
            assert torch.equal(back, full), (shape, dim, sections)
            if dim is not None:  # the shard is this rank's piece of every section, in section order
                assert torch.equal(local, full.index_select(dim, own_columns(shape[dim], sections, r, tp)))


def test_shard_of_rejects_wrong_shape():
    with pytest.raises(ValueError, match="does not match"):
        shard_of(torch.zeros(4, 4), ShardSpec((8, 4), 0, 1, 0, 2))


# --- TPRNGTracker ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", TPS)
def test_rng_tracker_streams(tp):
    def work(topo):
        seed_default_stream(1234)
        tracker = TPRNGTracker(1234, topo.tp_rank)
        with tracker.fork():
            tp_first = torch.rand(6)
        default = torch.rand(6)
        with tracker.fork():
            tp_second = torch.rand(6)
        default_after = torch.rand(6)
        # The tp stream is one continuing stream; the default stream is untouched by the forks.
        again = TPRNGTracker(1234, topo.tp_rank)
        with again.fork():
            tp_continuous = torch.rand(12)
        seed_default_stream(1234)
        default_continuous = torch.rand(12)
        return tp_first, tp_second, tp_continuous, torch.cat([default, default_after]), default_continuous

    results = on_tp(tp, work)
    for tp_first, tp_second, tp_continuous, default, default_continuous in results:
        assert torch.equal(torch.cat([tp_first, tp_second]), tp_continuous)
        assert torch.equal(default, default_continuous)
        assert not torch.equal(tp_first, default[:6])
    for r in range(tp):
        for q in range(r + 1, tp):
            assert not torch.equal(results[r][0], results[q][0]), f"tp ranks {r} and {q} share the tp stream"
        assert torch.equal(results[r][3], results[0][3]), "the default stream must be replicated across tp ranks"


def test_rng_tracker_replayable_replays_and_restores():
    tracker = TPRNGTracker(99, tp_rank=1)
    fresh = TPRNGTracker(99, tp_rank=1)
    with fresh.fork():
        stream = torch.rand(14)  # the tp stream drawn in one go, for reference

    def draw(n):
        with tracker.fork():
            return torch.rand(n)

    run = tracker.replayable(draw)
    first = run(5)
    after_first = tracker.get_state()
    assert torch.equal(first, stream[:5])
    # A replay right after the first call draws the same numbers and leaves the stream where the first call did.
    assert torch.equal(run(5), first)
    assert torch.equal(tracker.get_state(), after_first)
    # Later draws (the following blocks' forward) move the stream on; a replay (the recompute in backward) still
    # draws the first call's numbers, and leaves the stream where it found it.
    assert torch.equal(draw(3), stream[5:8])
    before_replay = tracker.get_state()
    assert torch.equal(run(5), first)
    assert torch.equal(tracker.get_state(), before_replay)
    assert torch.equal(draw(6), stream[8:14])
