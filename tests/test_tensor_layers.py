"""Tensor-parallel pieces against a dense single-process reference built from the same full weights.

Every multi-rank check runs on tp = 2 and 4 forked gloo ranks (tests/harness.py). The ranks return their local
results; the parent compares them with plain torch ops (F.linear, F.embedding, F.cross_entropy) on the full
tensors. Matmul results agree to fp32 rounding (reduction order differs); pure data movement is compared exactly.
"""

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed

from megazoo.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, ShardSpec, TPRNGTracker, VocabParallelEmbedding,
                             copy_to_tp_region, gather_from_tp_region, gather_full, reduce_from_tp_region,
                             scatter_to_tp_region, shard_of, vocab_parallel_cross_entropy)
from megazoo.parallel.tensor.random import seed_default_stream
from megazoo.parallel.topology import Topology

TPS = (2, 4)
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32, O(1) values: only the summation order differs from the reference
B, S = 2, 3


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def on_tp(tp, fn, *args):
    """Run fn(topology, *args) on `tp` ranks forming one tensor-parallel group; per-rank results."""

    def body(*a):
        return fn(Topology.build(dp=1, tp=tp), *a)

    return run_distributed(body, tp, *args)


def own_columns(total, sections, rank, tp):
    """Indices (along the split dim) of the global tensor that `rank` holds: its piece of every section."""
    block = total // sections
    piece = block // tp
    return torch.cat([torch.arange(s * block + rank * piece, s * block + (rank + 1) * piece) for s in range(sections)])


def load_full(layer, full: dict):
    """Give `layer` its shard of each full tensor (shard_of with the layer's own ShardSpec)."""
    with torch.no_grad():
        for name, tensor in full.items():
            getattr(layer, name).copy_(shard_of(tensor, layer.shard_specs[name]))


def full_grads(layer, topo):
    return {name: gather_full(getattr(layer, name).grad, spec, topo.tp_group)
            for name, spec in layer.shard_specs.items()}


def dense_linear(x, w, b, upstream):
    """Output and gradients of F.linear for the upstream gradient `upstream`."""
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = F.linear(x, w, b)
    y.backward(upstream)
    return y.detach(), x.grad, {"weight": w.grad, "bias": b.grad}


# --- ColumnParallelLinear -------------------------------------------------------------------------------------

C_IN, C_OUT = 8, 24  # 24 = 3 sections x 4 ranks x 2


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear_matches_dense(tp, gather_output):
    x, w, b, g = randn(B, S, C_IN, seed=1), randn(C_OUT, C_IN, seed=2), randn(C_OUT, seed=3), randn(B, S, C_OUT, seed=4)
    ref_y, ref_dx, ref_dw = dense_linear(x, w, b, g)

    def work(topo):
        layer = ColumnParallelLinear(C_IN, C_OUT, topo.tp_group, gather_output=gather_output)
        load_full(layer, {"weight": w, "bias": b})
        cols = own_columns(C_OUT, 1, topo.tp_rank, tp)
        assert torch.equal(layer.weight, w[cols]) and torch.equal(layer.bias, b[cols])
        xin = x.clone().requires_grad_()
        y = layer(xin)
        # Upstream gradient of this rank's output: the full one when gathered, else this rank's columns of it.
        y.backward(g if gather_output else g[..., cols])
        return y.detach(), xin.grad, full_grads(layer, topo)

    for rank, (y, dx, grads) in enumerate(on_tp(tp, work)):
        expected = ref_y if gather_output else ref_y[..., own_columns(C_OUT, 1, rank, tp)]
        assert y.shape == expected.shape
        torch.testing.assert_close(y, expected, **TOL)
        torch.testing.assert_close(dx, ref_dx, **TOL)  # copy_to_tp_region summed the ranks' partial dx
        for name in ("weight", "bias"):
            torch.testing.assert_close(grads[name], ref_dw[name], **TOL)


@pytest.mark.parametrize("tp", TPS)
def test_column_parallel_fused_qkv_holds_whole_heads_of_each_section(tp):
    x, w, b, g = randn(B, S, C_IN, seed=5), randn(C_OUT, C_IN, seed=6), randn(C_OUT, seed=7), randn(B, S, C_OUT, seed=8)
    ref_y, ref_dx, ref_dw = dense_linear(x, w, b, g)
    block = C_OUT // 3  # [Q; K; V]
    piece = block // tp

    def work(topo):
        layer = ColumnParallelLinear(C_IN, C_OUT, topo.tp_group, sections=3)
        load_full(layer, {"weight": w, "bias": b})
        cols = own_columns(C_OUT, 3, topo.tp_rank, tp)
        assert torch.equal(layer.weight, w[cols]) and torch.equal(layer.bias, b[cols])
        xin = x.clone().requires_grad_()
        y = layer(xin)
        y.backward(g[..., cols])
        return y.detach(), xin.grad, full_grads(layer, topo)

    for rank, (y, dx, grads) in enumerate(on_tp(tp, work)):
        assert y.shape == (B, S, 3 * piece)
        q, k, v = y.split(piece, dim=-1)
        for section, local in enumerate((q, k, v)):
            lo = section * block + rank * piece
            torch.testing.assert_close(local, ref_y[..., lo:lo + piece], **TOL)
        torch.testing.assert_close(dx, ref_dx, **TOL)
        for name in ("weight", "bias"):
            torch.testing.assert_close(grads[name], ref_dw[name], **TOL)


def test_column_parallel_rejects_bad_layouts():
    with pytest.raises(ValueError, match="not divisible"):
        ColumnParallelLinear(4, 10, None, sections=3)
    with pytest.raises(ValueError, match="gather_output"):
        ColumnParallelLinear(4, 12, None, sections=3, gather_output=True)


# --- RowParallelLinear ----------------------------------------------------------------------------------------

R_IN, R_OUT = 8, 6


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_dense(tp, input_is_parallel):
    x, w, b, g = randn(B, S, R_IN, seed=11), randn(R_OUT, R_IN, seed=12), randn(R_OUT, seed=13), randn(B, S, R_OUT, seed=14)
    ref_y, ref_dx, ref_dw = dense_linear(x, w, b, g)
    width = R_IN // tp

    def work(topo):
        layer = RowParallelLinear(R_IN, R_OUT, topo.tp_group, input_is_parallel=input_is_parallel)
        load_full(layer, {"weight": w, "bias": b})
        lo = topo.tp_rank * width
        assert torch.equal(layer.weight, w[:, lo:lo + width]) and torch.equal(layer.bias, b)
        xin = (x[..., lo:lo + width] if input_is_parallel else x).clone().requires_grad_()
        y = layer(xin)
        y.backward(g)  # the output is replicated: every rank receives the same upstream gradient
        return y.detach(), xin.grad, full_grads(layer, topo)

    for rank, (y, dx, grads) in enumerate(on_tp(tp, work)):
        torch.testing.assert_close(y, ref_y, **TOL)
        lo = rank * width
        # Parallel input: this rank's slice of dx. Full input: scatter's backward all-gathered the whole dx.
        torch.testing.assert_close(dx, ref_dx[..., lo:lo + width] if input_is_parallel else ref_dx, **TOL)
        for name in ("weight", "bias"):
            torch.testing.assert_close(grads[name], ref_dw[name], **TOL)


# --- VocabParallelEmbedding -----------------------------------------------------------------------------------

E_VOCAB, E_DIM = 32, 5


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_embedding_matches_dense(tp):
    gen = torch.Generator().manual_seed(21)
    # Every id once (so every shard is hit) plus repeats (gradient accumulation into the same row).
    ids = torch.cat([torch.randperm(E_VOCAB, generator=gen), torch.randint(0, E_VOCAB, (16,), generator=gen)])
    ids = ids.view(6, 8)
    w, g = randn(E_VOCAB, E_DIM, seed=22), randn(6, 8, E_DIM, seed=23)
    w_ref = w.clone().requires_grad_()
    ref_y = F.embedding(ids, w_ref)
    ref_y.backward(g)

    def work(topo):
        layer = VocabParallelEmbedding(E_VOCAB, E_DIM, topo.tp_group)
        load_full(layer, {"weight": w})
        rows = E_VOCAB // tp
        assert (layer.vocab_start, layer.vocab_end) == (topo.tp_rank * rows, (topo.tp_rank + 1) * rows)
        y = layer(ids)
        y.backward(g)
        return y.detach(), full_grads(layer, topo)["weight"], layer.weight.grad

    for rank, (y, dw, local_dw) in enumerate(on_tp(tp, work)):
        torch.testing.assert_close(y, ref_y.detach(), **TOL)
        torch.testing.assert_close(dw, w_ref.grad, **TOL)
        rows = E_VOCAB // tp
        torch.testing.assert_close(local_dw, w_ref.grad[rank * rows:(rank + 1) * rows], **TOL)


# --- vocab_parallel_cross_entropy -----------------------------------------------------------------------------

LOCAL_VOCAB = 5


def _vocab_case(case, tp):
    padded = LOCAL_VOCAB * tp
    return {"unpadded": padded,
            "padded": padded - 2,  # the last shard holds 3 real columns and 2 of padding
            "whole_shard_padding": LOCAL_VOCAB * (tp - 1) - 2}[case]  # last shard all padding, the one before partly


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("case", ["unpadded", "padded", "whole_shard_padding"])
def test_vocab_parallel_cross_entropy_matches_dense(tp, case):
    vocab, padded = _vocab_case(case, tp), LOCAL_VOCAB * tp
    logits = 3 * randn(3, 4, padded, seed=31)
    logits[..., vocab:] = 30.0  # padding columns would dominate the softmax if they were not masked
    gen = torch.Generator().manual_seed(32)
    targets = torch.randint(0, vocab, (3, 4), generator=gen)
    targets[0, 0], targets[0, 1] = vocab - 1, 0  # the last real id and the first
    targets[1, 2] = targets[2, 3] = -100
    ignored = targets == -100
    weights = randn(3, 4, seed=33)  # upstream gradient of the per-token losses

    ref_logits = logits[..., :vocab].clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab), targets.reshape(-1), reduction="none",
                               ignore_index=-100).view(3, 4)
    (ref_loss * weights).sum().backward()
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(3, 4, padded - vocab)], dim=-1)

    def work(topo):
        lo = topo.tp_rank * LOCAL_VOCAB
        local = logits[..., lo:lo + LOCAL_VOCAB].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, topo.tp_group, vocab)
        (loss * weights).sum().backward()
        return loss.detach(), local.grad

    for rank, (loss, grad) in enumerate(on_tp(tp, work)):
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        assert torch.all(loss[ignored] == 0)
        lo = rank * LOCAL_VOCAB
        torch.testing.assert_close(grad, ref_grad[..., lo:lo + LOCAL_VOCAB], **TOL)
        assert torch.all(grad[ignored] == 0), "ignored targets must get no gradient"
        padding_cols = max(0, lo + LOCAL_VOCAB - max(vocab, lo))
        if padding_cols:
            assert torch.all(grad[..., LOCAL_VOCAB - padding_cols:] == 0), "padding columns must get no gradient"


def test_vocab_parallel_cross_entropy_without_group_is_plain_cross_entropy():
    logits, vocab = randn(7, 12, seed=41), 10
    targets = torch.tensor([0, 9, 3, -100, 5, 9, 1])
    mine, ref = logits.clone().requires_grad_(), logits[:, :vocab].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, targets, None, vocab)
    ref_loss = F.cross_entropy(ref, targets, reduction="none")
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    loss.sum().backward()
    ref_loss.sum().backward()
    torch.testing.assert_close(mine.grad[:, :vocab], ref.grad, **TOL)
    assert torch.all(mine.grad[:, vocab:] == 0)


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
