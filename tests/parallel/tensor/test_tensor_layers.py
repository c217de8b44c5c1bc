"""Tensor-parallel layers against a dense single-process reference built from the same full weights.

Every multi-rank check runs on tp = 2 and 4 forked gloo ranks (tests/harness.py). The ranks return their local
results; the parent compares them with plain torch ops (F.linear, F.embedding, F.cross_entropy) on the full
tensors. Matmul results agree to fp32 rounding (reduction order differs); pure data movement is compared exactly.
"""

import pytest
import torch
import torch.nn.functional as F
from tensor_helpers import B, S, TOL, TPS, on_tp, own_columns, randn

from megazoo.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                     gather_full, shard_of, vocab_parallel_cross_entropy)


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
