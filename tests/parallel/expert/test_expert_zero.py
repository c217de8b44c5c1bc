"""ZeRO 0-3 under expert parallelism: dense weights reduced over dp x cp, expert weights over their expert-data-
parallel group, with the mean over every rank's tokens; the same steps as one process holding every expert.

A toy MoE layer (dense input projection and router, routed experts through parallel/expert's dispatch) trains
three AdamW steps with an active gradient clip on every dp rank's own batch. The parent runs the same three steps
on one process, every expert local, on the concatenation of the ranks' batches (the mean of their losses). Every
dense parameter on every rank, every rank's expert slice and the first step's gradient norm agree to 1e-10 (fp64).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from harness import run_distributed

from megazoo.parallel.expert import dispatch_combine
from megazoo.parallel.tensor import ShardSpec
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.build import build_zero
from megazoo.parallel.expert.zero import build_expert_split
from megazoo.parallel.zero.interface import optimizer_step

E, D, F, K, T, STEPS, TOL = 4, 4, 3, 2, 6, 3, 1e-10
LR, CLIP, WD = 0.05, 0.3, 0.1
EXPERTS = ("w1", "w2")


class ToyMoE(nn.Module):
    def __init__(self, ep: int = 1, ep_rank: int = 0, group=None):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.inp = nn.Linear(D, D, dtype=torch.float64)
        self.router = nn.Linear(D, E, bias=False, dtype=torch.float64)
        with torch.no_grad():
            for p in (self.inp.weight, self.inp.bias, self.router.weight):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        n = E // ep
        full = [torch.randn(E, D, F, generator=g, dtype=torch.float64),
                torch.randn(E, F, D, generator=g, dtype=torch.float64)]
        self.w1, self.w2 = (nn.Parameter(w[ep_rank * n:(ep_rank + 1) * n].clone()) for w in full)
        self.ep, self.ep_rank, self.group = ep, ep_rank, group

    def experts(self, rows, counts):
        outs = [torch.tanh(c @ self.w1[e]) @ self.w2[e] for e, c in enumerate(rows.split(counts.tolist()))]
        return torch.cat(outs)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        weights, indices = torch.softmax(self.router(h), -1).topk(K, dim=-1)
        return h + dispatch_combine(h, weights, indices, self.experts, E, self.group)

    def named(self):
        out = []
        for name, p in self.named_parameters():
            spec = (ShardSpec((E, *p.shape[1:]), dim=0, rank=self.ep_rank, size=self.ep) if name in EXPERTS
                    else ShardSpec(tuple(p.shape)))
            out.append((name, p, spec))
        return out


def _batch(rank: int):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(T, D, generator=g, dtype=torch.float64), torch.randn(T, D, generator=g, dtype=torch.float64)


def _reference(ranks: int):
    """(full parameters after STEPS, first gradient norm) on one process: the mean of the ranks' losses."""
    model = ToyMoE()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, foreach=False)
    norms = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum(((model(x) - y) ** 2).mean() for x, y in map(_batch, range(ranks))) / ranks
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, norms[0]


def _on_rank(dp: int, ep: int, stages: tuple[int, ...]):
    topo = Topology.build(dp=dp, ep=ep)
    out = {}
    for stage in stages:
        model = ToyMoE(ep, topo.ep_rank, topo.ep_group)
        zero = build_expert_split(build_zero, stage, model, model.named(), topo, lambda n: n in EXPERTS, lr=LR,
                                  weight_decay=WD)
        x, y = _batch(topo.grad_rank)
        norms = []
        for _ in range(STEPS):
            zero.begin_micro_batch(True)
            ((model(x) - y) ** 2).mean().backward()
            norms.append(optimizer_step(zero, lr=LR, grad_clip=CLIP, device=topo.device).grad_norm)
        with zero.gathered():
            out[stage] = ({n: p.detach().clone() for n, p in model.named_parameters()}, norms[0], topo.ep_rank)
    return out


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (4, 4)])
def test_expert_zero_equals_one_process(world, ep):
    stages = (0, 1, 2, 3)
    want, want_norm = _reference(world)
    n = E // ep
    for rank, per_stage in enumerate(run_distributed(_on_rank, world, world, ep, stages)):
        for stage, (params, norm, ep_rank) in per_stage.items():
            where = f"dp {world} ep {ep} stage {stage} rank {rank}"
            torch.testing.assert_close(norm, want_norm, rtol=0, atol=TOL, msg=f"{where}: grad norm")
            for name, value in params.items():
                expected = want[name][ep_rank * n:(ep_rank + 1) * n] if name in EXPERTS else want[name]
                torch.testing.assert_close(value, expected, rtol=0, atol=TOL, msg=f"{where}: {name}")
