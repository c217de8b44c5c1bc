"""Topology's ep dimension: ep ranks carved out of dp x cp (consecutive grad ranks), the expert-data-parallel
groups (the ranks holding the same experts), and the layout check naming parallel.ep."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from harness import run_distributed

from megazoo.parallel.topology import Topology, check_expert_layout


def _members(group, rank):
    return sorted(dist.get_process_group_ranks(group)) if group is not None else [rank]


def _groups(dp, tp, cp, ep):
    topo = Topology.build(dp=dp, tp=tp, cp=cp, ep=ep)
    return (topo.ep_rank, topo.edp_rank, topo.edp, _members(topo.ep_group, topo.rank),
            _members(topo.edp_group, topo.rank), topo.describe())


@pytest.mark.parametrize("dp, tp, cp, ep, ep_groups, edp_groups", [
    (4, 1, 1, 2, [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),  # dp 4 = ep 2 x edp 2
    (2, 2, 1, 2, [[0, 2], [1, 3], [0, 2], [1, 3]], [[0], [1], [2], [3]]),  # ep at each tp position, edp 1
    (2, 1, 2, 4, [[0, 1, 2, 3]] * 4, [[0], [1], [2], [3]]),  # ep spans dp x cp
    (2, 1, 2, 2, [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),  # ep over cp first
])
def test_expert_groups(dp, tp, cp, ep, ep_groups, edp_groups):
    got = run_distributed(_groups, 4, dp, tp, cp, ep)
    assert [g[3] for g in got] == ep_groups
    assert [g[4] for g in got] == edp_groups
    for rank, (ep_rank, edp_rank, edp, *_rest) in enumerate(got):
        assert ep_rank == _rest[0].index(rank) and edp == 4 // tp // ep
        assert edp_rank == _rest[1].index(rank)
    assert f"ep 1/{ep}" in got[ep_groups[0][1]][5]


def test_ep_one_is_no_group():
    got = run_distributed(lambda: (Topology.build(dp=2).ep_group, Topology.build(dp=2).edp_group), 2)
    assert got == [(None, None), (None, None)]
    solo = Topology.solo()
    assert (solo.ep, solo.ep_rank, solo.edp, solo.edp_rank) == (1, 0, 1, 0)


def test_expert_layout_is_checked():
    check_expert_layout(4, 2, 2)
    with pytest.raises(ValueError, match=r"parallel.ep = 3 does not divide parallel.dp x parallel.cp = 4 x 1 = 4 "
                                         r"\(expert parallelism is carved out of them\); valid: \[1, 2, 4\]"):
        check_expert_layout(3, 4)
    with pytest.raises(ValueError, match="parallel.ep = 0 is invalid"):
        check_expert_layout(0, 4)
    with pytest.raises(ValueError, match="parallel.ep = 2 does not divide"):
        Topology.build(dp=1, ep=2)  # refused before any process group is needed
