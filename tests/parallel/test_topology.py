"""Topology: the (pp, dp, tp) mesh with tp innermost, groups of one as None, and layout errors."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from harness import run_distributed

from megazoo.parallel.topology import Topology, check_layout


def _coordinates(dp, tp):
    topo = Topology.build(dp=dp, tp=tp)
    tp_members = dist.get_process_group_ranks(topo.tp_group) if topo.tp_group is not None else [topo.rank]
    dp_members = dist.get_process_group_ranks(topo.dp_group) if topo.dp_group is not None else [topo.rank]
    return topo.rank, topo.dp_rank, topo.tp_rank, sorted(tp_members), sorted(dp_members), topo.device.type


def test_tp_is_innermost_on_four_ranks():
    got = run_distributed(_coordinates, 4, 2, 2)
    assert [g[:3] for g in got] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert [g[3] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # tp groups are adjacent ranks
    assert [g[4] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g[5] == "cpu" for g in got)  # gloo on CPU


def test_groups_of_one_are_none():
    got = run_distributed(lambda: Topology.build(dp=2, tp=1).tp_group is None, 2)
    assert got == [True, True]
    solo = Topology.solo()
    assert (solo.world_size, solo.dp_group, solo.tp_group, solo.pp_group) == (1, None, None, None)


def test_layout_must_match_world_size():
    with pytest.raises(ValueError, match=r"dp=3 x tp=1 x pp=1 = 3 processes, but the world size is 2"):
        check_layout(3, 1, 1, 2)
    with pytest.raises(ValueError, match="parallel.tp = 0"):
        check_layout(1, 0, 1, 1)

    def build_wrong():
        try:
            Topology.build(dp=3)
        except ValueError as err:
            return str(err)

    assert all("world size is 2" in msg for msg in run_distributed(build_wrong, 2))


def test_multi_process_layout_without_process_group_is_refused():
    with pytest.raises(RuntimeError, match="needs 2 processes but no process group"):
        Topology.build(dp=2)
