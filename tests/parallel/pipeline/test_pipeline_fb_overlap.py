"""DualPipe-V's forward/backward overlap with expert parallelism (parallel/pipeline/fb_overlap.py,
overlap_engine.py, moe_stages.py) on a tiny MoE chunk written both ways: an ordinary module whose MoE goes through
the library's dispatcher (expert/dispatch.py, synchronous all-to-alls), and the same layers as moe_stages'
sub-stages (route | dispatch | experts | combine). fp64: the overlapped run equals the non-overlapped one and a dense single process to 1e-12,
and the recorded events show each all-to-all of one micro-batch in flight while the other micro-batch computes."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from megazoo.parallel.expert.dispatch import dispatch_combine
from megazoo.parallel.pipeline.engine import PipelineEngine
from megazoo.parallel.pipeline.fb_overlap import (Events, backward_steps, forward_steps, overlapped, run, run_pair,
                                                  weight_steps)
from megazoo.parallel.pipeline.moe_stages import moe_sub_stages
from megazoo.parallel.pipeline.overlap_engine import OverlapPipelineEngine, overlap_plan, pairs
from megazoo.parallel.pipeline.p2p import check_plan, plan_for
from megazoo.parallel.topology import Topology, group_rank, group_size

D, E, V, B, S = 4, 4, 11, 2, 3  # width, routed experts, vocabulary, micro-batch rows, sequence
TOL = 1e-12


class ToyMoE(torch.nn.Module):
    """Layers of h1 = h + tanh(h Wa) ("attention"), then top-1 routing of h1 over E experts, each expert
    tanh(rows We): h = h1 + w * expert(h1). `first`: an embedding of token ids comes first. This rank's experts
    are its ep block of the E (all of them with group None)."""

    def __init__(self, layers: list[int], first: bool, group=None):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        full = [(torch.randn(D, D, generator=g) * 0.5, torch.randn(D, E, generator=g),
                 torch.randn(E, D, D, generator=g) * 0.5) for _ in range(4)]
        emb = torch.randn(V, D, generator=g)
        ep, me = group_size(group), group_rank(group)
        n = E // ep
        self.group, self.layers, self.n = group, layers, n
        self.emb = torch.nn.Parameter(emb.double()) if first else None
        self.wa = torch.nn.ParameterList([torch.nn.Parameter(full[i][0].double()) for i in layers])
        self.wr = torch.nn.ParameterList([torch.nn.Parameter(full[i][1].double()) for i in layers])
        self.we = torch.nn.ParameterList([torch.nn.Parameter(full[i][2][me * n:(me + 1) * n].double())
                                          for i in layers])

    def _experts(self, j: int):
        def fn(rows, counts):
            parts = rows.split(counts.tolist())
            return torch.cat([torch.tanh(p @ self.we[j][e]) for e, p in enumerate(parts)])
        return fn

    def _attn(self, j: int, h: torch.Tensor):
        h1 = h + torch.tanh(h @ self.wa[j])
        w, idx = torch.softmax(h1 @ self.wr[j], -1).topk(1, -1)
        return h1, w, idx

    def forward(self, x):
        h = self.emb[x] if self.emb is not None else x
        shape = h.shape
        h = h.reshape(-1, D)
        for j in range(len(self.layers)):
            h1, w, idx = self._attn(j, h)
            h = h1 + dispatch_combine(h1, w, idx, self._experts(j), E, self.group)
        return h.view(shape)

    def sub_stages(self):
        stages = []
        last = len(self.layers) - 1
        for j in range(len(self.layers)):
            def before(ctx, inputs, j=j):
                (h,) = inputs
                if j == 0:  # the chunk's input: token ids on the first stage, else (b, s, d)
                    ctx["shape"] = (*h.shape, D) if self.emb is not None else h.shape
                    h = (self.emb[h] if self.emb is not None else h).reshape(-1, D)
                return h + torch.tanh(h @ self.wa[j])

            def route(h, j=j):
                w, idx = torch.softmax(h @ self.wr[j], -1).topk(1, -1)
                return w, idx

            def after(ctx, h, moe, j=j):
                return ((h + moe).view(ctx["shape"]),) if j == last else (h + moe,)
            stages += moe_sub_stages(f"layer{j}", before, route, self._experts(j), after, E, self.group)
        return stages


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _data(rank: int, m: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, V, (B, S), generator=g), torch.randn(B, S, D, generator=g, dtype=torch.float64))
            for _ in range(m)]


def _grads(model: ToyMoE) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _pair_on_ep_rank():
    """ep 2, one stage of 2 layers: F(0); then F(1) overlapped with B(0); then B(1), against plain autograd."""
    import torch.distributed as dist
    rank, group = dist.get_rank(), dist.new_group([0, 1])
    data = _data(rank, 2)
    plain = ToyMoE([0, 1], True, group)
    for x, y in data:
        (_loss(plain(x), y) / 2).backward()
    staged, events = ToyMoE([0, 1], True, group), Events()

    def backward(record, out, y):
        leaf = out.requires_grad_()
        (_loss(leaf, y) / 2).backward()
        return backward_steps(record, leaf.grad, events)

    stages = staged.sub_stages()
    out0, rec0 = run(forward_steps(stages, data[0][0], 0, events))
    (out1, rec1), _ = run_pair(forward_steps(stages, data[1][0], 1, events), backward(rec0, out0, data[0][1]))
    run(backward(rec1, out1, data[1][1]))
    sends = [rec.ctx[f"layer{j}"]["send"] for rec in (rec0, rec1) for j in (0, 1)]
    return _grads(plain), _grads(staged), events.log, sends


def test_overlapped_pair_equals_plain_autograd_and_overlaps():
    for rank, (plain, staged, log, sends) in enumerate(run_distributed(_pair_on_ep_rank, 2)):
        assert any(split[1 - rank] > 0 for split in sends), sends  # rows did travel to the other ep rank
        assert plain.keys() == staged.keys()
        for name in plain:
            torch.testing.assert_close(staged[name], plain[name], rtol=0, atol=TOL, msg=f"rank {rank} {name}")
        seen = overlapped(Events(log))
        # Both directions: F's dispatch travels under B's computes, and B's gradient all-to-alls under F's.
        assert (1, "layer0.dispatch", "F", 0, "layer1.experts") in seen, seen
        assert any(p == "B" and m == 0 and other == 1 for m, _, p, other, _ in seen), seen
        # The per-expert counts' all-to-all is asynchronous too: micro 1's travels under micro 0's backward.
        assert (1, "layer0.counts", "F", 0, "layer1.combine") in seen, seen
        launches = [e for e in log if e[0] == "launch"]
        # 2 micro-batches x 2 layers x (dispatch, combine) x (F, B), and the counts once per layer's F
        assert len(launches) == 16 + 4 and sum(e[2].endswith(".counts") for e in launches) == 4


def _pipeline(m: int, overlap: bool):
    """pp 2 x ep 2 (ep inside dp 2), DualPipe-V over 4 virtual stages of one MoE layer each."""
    topo = Topology.build(2, 1, 2, ep=2)
    r = topo.pp_rank
    chunks = [ToyMoE([r], r == 0, topo.ep_group), ToyMoE([3 - r], False, topo.ep_group)]
    cls = OverlapPipelineEngine if overlap else PipelineEngine
    engine = cls(chunks, topo, hidden_size=D, activation_dtype=torch.float64, loss_fn=_loss, placement="v")
    steps = plan_for("dualpipev", m, 2, r, 2)
    calls: list[bool] = []  # before_backward's "is this the last gradient-accumulating action" flags
    losses = engine.run(_data(topo.dp_rank, m), steps, before_backward=calls.append)
    grads = {f"{r}.{c}.{n}": g for c, chunk in enumerate(chunks) for n, g in _grads(chunk).items()}
    log = engine.events.log if overlap else []
    n_pairs = len(pairs(overlap_plan(steps, 2, r)))
    return topo.pp_rank, topo.dp_rank, [float(x) for x in losses], grads, log, n_pairs, calls


def _dense(m: int, dp: int):
    """One process, every expert local: the mean loss over dp ranks and micro-batches."""
    model = ToyMoE([0, 1, 2, 3], True)
    losses = {}
    for rank in range(dp):
        for i, (x, y) in enumerate(_data(rank, m)):
            loss = _loss(model(x), y)
            (loss / (m * dp)).backward()
            losses[(rank, i)] = float(loss.detach())
    return losses, dict(model.named_parameters())


def test_dualpipev_overlap_equals_plain_dualpipev_and_dense_at_pp2_ep2():
    m = 4
    overlapped_runs = run_distributed(_pipeline, 4, m, True)
    plain_runs = run_distributed(_pipeline, 4, m, False)
    dense_losses, dense = _dense(m, 2)
    for got, ref in zip(overlapped_runs, plain_runs):
        pp_rank, dp_rank, losses, grads, log, n_pairs, calls = got
        assert calls[-1] and sum(calls) == 1 and ref[6][-1] and sum(ref[6]) == 1  # ZeRO-1's hook: once, last
        assert losses == ref[2]
        for name in grads:
            torch.testing.assert_close(grads[name], ref[3][name], rtol=0, atol=TOL, msg=name)
        if pp_rank == 0:  # the V's last stage is on pp rank 0
            for i, loss in enumerate(losses):
                assert abs(loss - dense_losses[(dp_rank, i)]) < TOL
        assert n_pairs >= 1
        # DualPipe-V's split backwards (a W in the plan) ran as B then W, sub-stage by sub-stage
        splits = [st.action for st in plan_for("dualpipev", m, 2, pp_rank, 2) if st.action and st.action[0] == "W"]
        w_computes = [e for e in log if e[0] == "compute" and e[3] == "W"]
        assert splits and len(w_computes) == 3 * len(splits)  # route, experts, combine of each split chunk
        seen = overlapped(Events(log))
        assert any(p == "F" for _, _, p, _, _ in seen) and any(p == "B" for _, _, p, _, _ in seen), seen
    # Gradients: non-expert ones averaged over dp (the trainer's all-reduce), expert ones held by their ep rank,
    # summed over dp by the all-to-all's backward: / dp for the mean.
    by_rank = {(g[0], g[1]): g[3] for g in overlapped_runs}
    compared = 0
    for stage in range(4):
        r, c = (stage, 0) if stage < 2 else (3 - stage, 1)
        for name in by_rank[(r, 0)]:
            if not name.startswith(f"{r}.{c}."):
                continue
            local = name.split(".", 2)[2]
            dense_name = local.replace("wa.0", f"wa.{stage}").replace("wr.0", f"wr.{stage}").replace(
                "we.0", f"we.{stage}")
            want = dense[dense_name].grad
            if local.startswith("we."):
                got = torch.cat([by_rank[(r, d)][name] for d in range(2)]) / 2
            else:
                got = (by_rank[(r, 0)][name] + by_rank[(r, 1)][name]) / 2
            torch.testing.assert_close(got, want, rtol=0, atol=TOL, msg=f"stage {stage} {local}")
            compared += 1
    assert compared == 1 + 4 * 3  # the embedding, and each stage's Wa, Wr and experts


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_the_overlapped_pairs_are_dualpipev_steady_rounds_on_the_checked_plan(pp, m):
    """The overlap engine's plan (overlap_plan: a transfer batch moved before an F/B pair when it does not carry
    the first one's output) passes p2p.check_plan (rendezvous rules, NCCL's); the engine pairs only an F and a
    B of different micro-batches with no transfer between them, and on every rank every one of the
    2 (m - 2 pp + r + 1) (F, B) pairs of DualPipe-V's steady rounds (F0, B1) (F1, B0)."""
    plans = [overlap_plan(plan_for("dualpipev", m, pp, r, 2), pp, r) for r in range(pp)]
    check_plan(plans)
    for r, steps in enumerate(plans):
        found = pairs(steps)
        for k in found:
            a, b = steps[k].action, steps[k + 1].action
            assert {a[0], b[0]} == {"F", "B"} and a[1] != b[1] and not steps[k + 1].transfers
        assert len(found) >= 2 * (m - 2 * pp + r + 1), (r, len(found))


@pytest.mark.parametrize("first", [False, True])
def test_a_split_backward_gives_input_gradients_at_b_and_weight_gradients_at_w(first):
    """The zero-bubble split inside the sub-stages (one process, every expert local): B returns the chunk input's
    gradient and leaves every parameter's .grad untouched; W then fills them; both exactly equal the unsplit
    sub-staged backward (and plain autograd to 1e-12). `first`: token ids in, no input gradient (each compute
    keeps its graph for W)."""
    x, y = _data(0, 1)[0]
    if not first:
        x = torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    plain, events = ToyMoE([0, 1], first), Events()
    leaf = x.clone().requires_grad_(not first)
    _loss(plain(leaf), y).backward()

    def backward(split: bool):
        model = ToyMoE([0, 1], first)
        out, record = run(forward_steps(model.sub_stages(), x, 0, events))
        out.requires_grad_()
        _loss(out, y).backward()
        return model, record, run(backward_steps(record, out.grad, events, split=split))

    whole, _, dx_whole = backward(False)
    staged, record, dx = backward(True)
    assert all(p.grad is None for p in staged.parameters()) and len(record.pending) == 6  # 3 computes x 2 layers
    assert (dx is None) == first and (first or torch.equal(dx, dx_whole))
    if not first:
        torch.testing.assert_close(dx, leaf.grad, rtol=0, atol=TOL)
    weight_steps(record, list(staged.parameters()), events)
    for (name, got), want, ref in zip(staged.named_parameters(), whole.parameters(), plain.parameters()):
        assert torch.equal(got.grad, want.grad), name
        torch.testing.assert_close(got.grad, ref.grad, rtol=0, atol=TOL, msg=name)
    assert [e[2] for e in events.log if e[3] == "W"] == [f"layer{j}.{c}" for j in (1, 0)
                                                           for c in ("combine", "experts", "route")]


def test_the_overlap_engine_refuses_chunks_without_sub_stages_and_packed_rows():
    topo = Topology.solo()
    with pytest.raises(ValueError, match=r"chunks \[0\] are not"):
        OverlapPipelineEngine([torch.nn.Linear(D, D)], topo, hidden_size=D, activation_dtype=torch.float64,
                              loss_fn=_loss)
    engine = OverlapPipelineEngine([ToyMoE([0], True)], topo, hidden_size=D, activation_dtype=torch.float64,
                                   loss_fn=_loss)
    steps = plan_for("1f1b", 1, 1, 0)
    x, y = _data(0, 1)[0]
    with pytest.raises(ValueError, match="without packed rows"):
        engine.run([(x, y, torch.zeros_like(x))], steps)
    # One process, every expert local (ep = 1: the exchanges pass through): equals the ordinary module.
    (loss,) = engine.run([(x, y)], steps)
    plain = ToyMoE([0], True)
    want = _loss(plain(x), y)
    want.backward()
    assert float(loss) == float(want.detach())
    for (name, got), ref in zip(engine.chunks[0].named_parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, ref.grad, rtol=0, atol=TOL, msg=name)
