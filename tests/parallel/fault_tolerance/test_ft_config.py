"""`[fault_tolerance]`: parsed into a frozen dataclass that refuses unknown keys, and every bad combination refused by
the resolver (before any process starts) with the field, the value and what is valid."""

from __future__ import annotations

import dataclasses

import pytest

from megazoo.parallel.fault_tolerance.config import FaultToleranceConfig
from megazoo.recipes.config import RecipeError
from recipe_helpers import tiny_recipe, tiny_resolved
from megazoo.recipes.resolve import resolve

ON = {"enabled": True, "replica_groups": 2}


def test_defaults_off_and_frozen():
    ft = tiny_recipe().fault_tolerance
    assert ft == FaultToleranceConfig() and not ft.enabled
    with pytest.raises(dataclasses.FrozenInstanceError):
        ft.enabled = True  # type: ignore[misc]


def test_unknown_key_refused():
    with pytest.raises(RecipeError, match=r"fault_tolerance\.replicas.*valid keys in.*replica_groups"):
        tiny_recipe(fault_tolerance={"replicas": 2})


def test_a_valid_section_resolves_with_the_whole_layouts_batch():
    res = tiny_resolved(parallel={"dp": 4}, fault_tolerance={**ON, "lighthouse": "http://node7:29510"})
    assert res.global_batch == 4 * 4  # micro_batch x grad_accum x dp: every group's share, when all are live
    assert res.recipe.fault_tolerance.lighthouse == "http://node7:29510"
    # one group's processes (dp 4 / 2 groups) or the whole job are both accepted as the world size
    resolve(res.recipe, world_size=2)
    resolve(res.recipe, world_size=4)
    with pytest.raises(RecipeError, match="each of the 2 replica groups runs 2"):
        resolve(res.recipe, world_size=3)


@pytest.mark.parametrize("sections, message", [
    ({"parallel": {"dp": 2}, "fault_tolerance": {**ON, "replica_groups": 1}},
     r"fault_tolerance\.replica_groups = 1 is invalid; valid: 2 or more"),
    ({"parallel": {"dp": 3}, "fault_tolerance": ON},
     r"replica_groups = 2 does not divide parallel\.dp = 3; valid: 3"),
    ({"parallel": {"dp": 1}, "fault_tolerance": ON},
     r"does not divide parallel\.dp = 1; valid: none"),
    ({"parallel": {"dp": 2}, "fault_tolerance": {**ON, "min_replicas": 3}},
     r"min_replicas = 3 is invalid; valid: 1 \.\. 2"),
    ({"parallel": {"dp": 2}, "fault_tolerance": {**ON, "timeout_s": 0.0}},
     r"fault_tolerance\.timeout_s = 0\.0 is invalid"),
    ({"parallel": {"dp": 2}, "fault_tolerance": {**ON, "lighthouse": "node7:29510"}},
     r"lighthouse = 'node7:29510' is invalid; valid: \"http://HOST:PORT\""),
    ({"parallel": {"dp": 2}, "fault_tolerance": {**ON, "max_group_restarts": -1}},
     r"max_group_restarts = -1 is invalid"),
    ({"parallel": {"dp": 2}, "optimizer": {"name": "onebit_adam"}, "fault_tolerance": ON},
     r"optimizer\.name = 'onebit_adam' is invalid; valid: \"adamw\""),
    ({"fault_tolerance": {"straggler_factor": 0.5}},
     r"straggler_factor = 0\.5 is invalid; valid: 0 \(off\) or a number > 1"),
    ({"fault_tolerance": {"straggler_steps": 0}}, r"straggler_steps = 0 is invalid"),
])
def test_bad_combinations_refused_before_any_process(sections, message):
    with pytest.raises(RecipeError, match=message):
        tiny_resolved(**sections)


def test_off_section_checks_nothing_of_the_layout():
    # replica_groups that would not divide dp are fine while fault tolerance is off
    tiny_resolved(parallel={"dp": 1}, fault_tolerance={"replica_groups": 3})


def test_zero3_and_hsdp_inside_a_group_resolve():
    """No longer refused (tests/parallel/fault_tolerance/test_replica_groups_zero3.py trains, kills and heals them)."""
    for zero, parallel in (({"stage": 3}, {"dp": 4}), ({"stage": 3, "shard_group": "node"}, {"dp": 4, "node_size": 2}),
                           ({"stage": 2, "shard_group": "node"}, {"dp": 4, "node_size": 1})):
        res = tiny_resolved(parallel=parallel, zero=zero, fault_tolerance=ON)
        assert res.recipe.zero.stage == zero["stage"] and res.global_batch == 4 * 4
