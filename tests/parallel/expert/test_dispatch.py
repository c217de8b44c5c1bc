"""Expert-parallel dispatch and combine (parallel/expert) equal a dense single-process MoE layer.

Each rank holds its own tokens (a different number per rank, one rank none at all at ep 4) and the weights of
its experts; the parent concatenates every rank's tokens and runs every expert locally, token by token. Outputs
and the gradients of tokens, routing weights and expert weights agree to 1e-10 in fp64, with routing that leaves
some (rank, expert) pairs and one expert entirely without tokens.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

from megazoo.parallel.expert import ExpertDispatcher, all_to_all_bytes, dispatch_combine
from megazoo.parallel.expert.dispatch import _rank_major_to_expert_major, check_expert_split

D, F, K, TOL = 6, 5, 2, 1e-10


def _tokens(ep: int) -> list[int]:
    return [5, 7, 0, 4][:ep] if ep == 4 else [6, 3]


def _rank_inputs(ep: int, rank: int):
    """(x, indices, weights, dy) of this rank. Expert 1 is never chosen; rank 1 never picks rank 0's experts."""
    experts, t = 2 * ep, _tokens(ep)[rank]
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(t, D, generator=g, dtype=torch.float64)
    allowed = torch.tensor([e for e in range(experts) if e != 1 and (rank != 1 or e >= 2)])
    scores = torch.rand(t, len(allowed), generator=g, dtype=torch.float64)
    indices = allowed[scores.topk(K, dim=-1).indices]  # distinct experts per token
    weights = torch.rand(t, K, generator=g, dtype=torch.float64)
    dy = torch.randn(t, D, generator=g, dtype=torch.float64)
    return x, indices, weights, dy


def _expert_weights(ep: int):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(2 * ep, D, F, generator=g, dtype=torch.float64),
            torch.randn(2 * ep, F, D, generator=g, dtype=torch.float64))


def _expert(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


def _loop_experts(w1, w2):
    """The per-expert loop over rows sorted by expert."""
    def run(rows, counts):
        outs = [_expert(chunk, w1[e], w2[e]) for e, chunk in enumerate(rows.split(counts.tolist()))]
        return torch.cat(outs) if outs else rows.new_zeros(0, D)
    return run


def _dense(ep: int):
    """Every rank's tokens through every expert, token by token: outputs per rank and all gradients."""
    w1, w2 = (w.clone().requires_grad_() for w in _expert_weights(ep))
    per_rank = [_rank_inputs(ep, r) for r in range(ep)]
    xs = [x.clone().requires_grad_() for x, *_ in per_rank]
    ws = [w.clone().requires_grad_() for _, _, w, _ in per_rank]
    outs, loss = [], 0.0
    for x, (_, idx, _, dy), w in zip(xs, per_rank, ws):
        rows = [sum(w[t, j] * _expert(x[t], w1[idx[t, j]], w2[idx[t, j]]) for j in range(K))
                for t in range(x.shape[0])]
        y = torch.stack(rows) if rows else x.new_zeros(0, D)
        outs.append(y.detach())
        loss = loss + (y * dy).sum()
    loss.backward()
    def grad(t):  # a rank without tokens: its (empty) inputs never entered the graph
        return torch.zeros_like(t) if t.grad is None else t.grad
    return outs, [grad(x) for x in xs], [grad(w) for w in ws], w1.grad, w2.grad


def _on_ep_rank(ep: int):
    import torch.distributed as dist
    rank = dist.get_rank()
    group = dist.new_group(list(range(ep)))
    dispatcher = ExpertDispatcher(2 * ep, group)
    mine = dispatcher.local_experts
    w1, w2 = (w[mine.start:mine.stop].clone().requires_grad_() for w in _expert_weights(ep))
    x, indices, weights, dy = _rank_inputs(ep, rank)
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = dispatcher(x, weights, indices, _loop_experts(w1, w2))
    (y * dy).sum().backward()
    grads = x.grad, weights.grad, w1.grad.clone(), w2.grad.clone()
    # Rows that left this rank: its pairs for other ranks' experts (dispatch; their gradients in backward), and
    # what it received from others (sent back by the combine, their gradients back again in backward).
    n = len(mine)
    away = int((indices // n != rank).sum())
    arrived = sum(int((_rank_inputs(ep, r)[1] // n == rank).sum()) for r in range(ep) if r != rank)
    counted = dispatcher.comm.bytes["all_to_all"], 2 * (away + arrived) * D * 8
    # Uniform routing (token t to experts t and t + 1, T a multiple of the experts): the formula's volume.
    uniform = ExpertDispatcher(2 * ep, group)
    t = 4 * ep
    idx = torch.stack([torch.arange(t) % (2 * ep), (torch.arange(t) + 1) % (2 * ep)], 1)
    xu = torch.randn(t, D, dtype=torch.float64, requires_grad=True)
    uniform(xu, torch.ones(t, K, dtype=torch.float64), idx, _loop_experts(w1, w2)).sum().backward()
    formula = uniform.comm.bytes["all_to_all"], all_to_all_bytes(t, K, D, ep, 8)
    return (y.detach(), *grads, counted, formula)


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_equals_dense(ep):
    results = run_distributed(_on_ep_rank, ep, ep)
    outs, dxs, dws, dw1, dw2 = _dense(ep)
    for rank, (y, dx, dw, g1, g2, counted, formula) in enumerate(results):
        assert counted[0] == counted[1] and counted[0] > 0, f"rank {rank}: counted all-to-all bytes {counted}"
        assert formula[0] == formula[1], f"rank {rank}: uniform routing's bytes vs the formula {formula}"
        torch.testing.assert_close(y, outs[rank], rtol=0, atol=TOL, msg=f"ep={ep} rank {rank} output")
        torch.testing.assert_close(dx, dxs[rank], rtol=0, atol=TOL, msg=f"ep={ep} rank {rank} token grad")
        torch.testing.assert_close(dw, dws[rank], rtol=0, atol=TOL, msg=f"ep={ep} rank {rank} weight grad")
        torch.testing.assert_close(g1, dw1[2 * rank:2 * rank + 2], rtol=0, atol=TOL, msg=f"rank {rank} w1 grad")
        torch.testing.assert_close(g2, dw2[2 * rank:2 * rank + 2], rtol=0, atol=TOL, msg=f"rank {rank} w2 grad")
    assert dw1[1].abs().sum() == 0  # the never-chosen expert: its (zero) gradient came back too


def test_local_dispatch_equals_dense():
    """ep = 1 (no group): the same code with no collective, all four ranks' tokens on one process."""
    ep = 4
    outs, dxs, dws, dw1, dw2 = _dense(ep)
    w1, w2 = (w.clone().requires_grad_() for w in _expert_weights(ep))
    for rank in range(ep):
        x, indices, weights, dy = _rank_inputs(ep, rank)
        x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y = dispatch_combine(x, weights, indices, _loop_experts(w1, w2), 2 * ep)
        (y * dy).sum().backward()
        torch.testing.assert_close(y.detach(), outs[rank], rtol=0, atol=TOL)
        torch.testing.assert_close(x.grad, dxs[rank], rtol=0, atol=TOL)
        torch.testing.assert_close(weights.grad, dws[rank], rtol=0, atol=TOL)
    torch.testing.assert_close(w1.grad, dw1, rtol=0, atol=TOL)
    torch.testing.assert_close(w2.grad, dw2, rtol=0, atol=TOL)


def test_regroup_is_expert_major():
    received = torch.tensor([[2, 0, 1], [1, 3, 0]])  # rows from rank 0: e0 x2, e2 x1; from rank 1: e0, e1 x3
    # buffer rows: [r0e0, r0e0, r0e2, r1e0, r1e1, r1e1, r1e1] -> expert-major: e0 (r0, r0, r1), e1 (r1 x3), e2
    assert _rank_major_to_expert_major(received, 7).tolist() == [0, 1, 3, 4, 5, 6, 2]


def test_expert_split_is_checked():
    assert check_expert_split(8, 4) == 2
    with pytest.raises(ValueError, match=r"parallel.ep = 3 does not divide the model's 8 routed experts; "
                                         r"valid: \[1, 2, 4, 8\]"):
        check_expert_split(8, 3)
    with pytest.raises(ValueError, match="parallel.ep = 0 is invalid"):
        ExpertDispatcher(8, None) and check_expert_split(8, 0)


def test_fake_tensors_route_uniformly_and_count_the_formula():
    """The dry run (fake process group, tensors without values) runs the dispatch with the uniform splits, so the
    bytes it counts equal all_to_all_bytes exactly; shapes come out right in forward and backward."""
    import torch.distributed as dist

    from megazoo.parallel.simulation.fake_world import fake_process_group, fake_tensors

    ep, t = 4, 10  # 20 (token, expert) rows: 5 per rank, 15 of them leave it, in each of the 4 all-to-alls
    with fake_process_group(1, ep), fake_tensors():
        dispatcher = ExpertDispatcher(2 * ep, dist.group.WORLD)
        w1, w2 = (torch.empty(2, *shape, dtype=torch.float64, requires_grad=True) for shape in ((D, F), (F, D)))
        x = torch.empty(t, D, dtype=torch.float64, requires_grad=True)
        indices = torch.empty(t, K, dtype=torch.int64)

        def experts(rows, counts):  # the grouped form: no host read of the counts
            return torch.tanh(rows @ w1[0]) @ w2[0]

        y = dispatcher(x, torch.empty(t, K, dtype=torch.float64), indices, experts)
        y.sum().backward()
        assert y.shape == (t, D) and x.grad.shape == (t, D) and w1.grad.shape == w1.shape
    assert dispatcher.comm.bytes["all_to_all"] == all_to_all_bytes(t, K, D, ep, 8)
