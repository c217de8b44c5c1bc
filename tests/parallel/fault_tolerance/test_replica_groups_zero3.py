"""ZeRO-3 and HSDP inside fault-tolerant replica groups (2 groups x 2 forked gloo ranks, torchft's lighthouse a child
process). Without a failure the groups train what the same total dp trains without fault tolerance (flat ZeRO-3 over
4 ranks; HSDP: a replica group is one HSDP replica, so 2 groups of one 2-rank node each train what HSDP over 2 nodes
trains). With one: rank 1 of group 1 is SIGKILLed in the middle of a step, the test ends its peer (torchrun's job) and
restarts the group (the launcher's); the other group never stops; the restarted group heals from the live one, and
then every rank's parameter shards, fp32 masters, Adam moments and update count are bitwise equal to the same rank
of the live group.

Robust under load: nothing waits on wall-clock time except safety-net timeouts; the live group holds (before a step,
never inside one) until the restarted group is about to ask for its first quorum, and the lighthouse waits up to 3 s
for a heartbeating group that has not asked yet, so the two meet at the live group's next quorum."""

from __future__ import annotations

import pytest
import torch

from ft_helpers import (assert_healed_bitwise_and_nothing_lost, end_group_after_a_death, finish, ft_sections, metrics,
                        patient_lighthouse, published_files, start_ranks, wait_for)
from harness import run_distributed
from recipe_helpers import tiny_recipe

from megazoo.parallel.topology import Topology
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

pytest.importorskip("torchft")
STEPS = 12
KILL_AT = 3  # the step in whose middle rank 1 of group 1 dies
EVERY = 2  # periodic checkpoints: group 1 has published step_2 before it dies
# a safety net only: nothing here waits for a clock, but a restarted group's first quorum may wait for the live
# group's step on a loaded machine
SLOW = {"quorum_timeout_s": 120.0, "timeout_s": 60.0, "start_timeout_s": 240.0}

LAYOUTS = {  # name: (parallel, zero, train) of the whole job: 2 replica groups of 2 ranks each
    # flat ZeRO-3 over each group's 2 ranks; bf16 (fp32 masters apart from the bf16 parameter shards: both healed)
    "zero3-bf16": ({"dp": 4}, {"stage": 3}, {"micro_batch": 2, "precision": "bf16"}),
    # HSDP: each group is one node of 2 ranks (ZeRO-3 shards inside it), the groups are HSDP's replicas
    "hsdp-zero3": ({"dp": 4, "node_size": 2}, {"stage": 3, "shard_group": "node"}, {"micro_batch": 2}),
    # HSDP inside a group that spans 2 nodes of 1 rank: ZeRO-2 over each node, the owned chunks all-reduced over
    # the group's nodes, then over the replica groups (torchft)
    "hsdp-zero2-2nodes": ({"dp": 4, "node_size": 1}, {"stage": 2, "shard_group": "node"},
                          {"micro_batch": 2, "grad_accum": 2}),
}


def _plain(sections: dict) -> dict:
    """The same recipe without fault tolerance, as one job over every dp rank (rank 0's view)."""
    recipe = tiny_recipe(**sections)
    trainer = Trainer(resolve(recipe), Topology.of(recipe.parallel))
    result = trainer.fit()
    return {"losses": result.losses, "full": trainer.full_state_dict()}


@pytest.mark.parametrize("layout", ["zero3-bf16", "hsdp-zero3"])
def test_without_failure_the_groups_train_what_the_same_dp_trains(tmp_path, layout):
    parallel, zero, train = LAYOUTS[layout]
    train = {**train, "precision": "fp64"}  # the comparison with another layout: rounding only
    sections = ft_sections(tmp_path, 6, parallel=parallel, zero=zero, train=train, fault_tolerance=SLOW)
    outs = [[tmp_path / f"g{g}r{r}.pt" for r in range(2)] for g in range(2)]
    house = patient_lighthouse()
    try:
        procs = [p for g in range(2) for p in start_ranks(g, sections, house.address, outs[g])]
        results = finish(procs, [o for pair in outs for o in pair], timeout_s=600)
    finally:
        house.stop()
    m0, m1 = metrics(tmp_path, 0), metrics(tmp_path, 1)
    assert [m["step"] for m in m0] == [m["step"] for m in m1] == list(range(6))
    assert all(m["replicas_live"] == 2 and m["committed"] for m in m0 + m1)
    for r in range(2):  # every rank of group 1 holds bitwise what the same rank of group 0 holds
        a, b = results[r], results[2 + r]
        assert a["names"] == b["names"] and a["optimizer_steps"] == b["optimizer_steps"] == 6
        assert any(n.startswith("param:") for n in a["names"])  # stage 3: the parameter shards are views too
        assert all(torch.equal(x, y) for x, y in zip(a["tensors"], b["tensors"]))
    plain_sections = {k: v for k, v in sections.items() if k not in ("fault_tolerance", "run")}
    plain = run_distributed(_plain, 4, plain_sections)[0]
    g0, g1 = results[0], results[2]
    for s, loss in enumerate(plain["losses"]):  # each group's loss is its half of the global batch
        assert abs((g0["losses"][s] + g1["losses"][s]) / 2 - loss) < 1e-12, s
    assert g0["full"].keys() == plain["full"].keys()
    assert all(torch.allclose(g0["full"][k], plain["full"][k], rtol=0, atol=1e-12) for k in plain["full"])


@pytest.mark.parametrize("layout", ["zero3-bf16", "hsdp-zero3", "hsdp-zero2-2nodes"])
def test_a_rank_killed_mid_step_its_group_rejoins_and_heals_bitwise(tmp_path, layout):
    parallel, zero, train = LAYOUTS[layout]
    sections = ft_sections(tmp_path, STEPS, parallel=parallel, zero=zero, train=train,
                           checkpoint={"every": EVERY, "keep": STEPS}, fault_tolerance=SLOW)
    outs = [[tmp_path / f"g{g}r{r}.pt" for r in range(2)] for g in range(2)]
    joining = tmp_path / "restarted-group-asks-for-its-first-quorum"
    hold = STEPS - 4  # group 0 waits before this step until the restarted group is joining: 4 quorums left to meet
    house = patient_lighthouse()
    try:
        group0 = start_ranks(0, sections, house.address, outs[0], holds=[(hold, joining)], snapshots=True)
        end_group_after_a_death(start_ranks(1, sections, house.address, outs[1], die=(1, "step", KILL_AT)), 1)
        before, lines_before = published_files(tmp_path, 1), metrics(tmp_path, 1)
        # the launcher's restart takes seconds; group 0 trains on alone meanwhile (it holds only at `hold`)
        wait_for(lambda: sum(m["replicas_live"] == 1 for m in metrics(tmp_path, 0)) >= 2, 600,
                 "group 0 to train 2 steps alone")
        group1 = start_ranks(1, sections, house.address, outs[1], restarted=True, joining=joining,
                             snapshots=True)
        results = finish(group0 + group1, [o for pair in outs for o in pair], timeout_s=600)
    finally:
        house.stop()
    m0, m1 = metrics(tmp_path, 0), metrics(tmp_path, 1)
    # group 0 never stopped: every step once (none lost, no committed step redone), each committed
    assert [m["step"] for m in m0] == list(range(STEPS)) and all(m["committed"] for m in m0)
    healed = [m for m in m1 if "healed_at_step" in m]
    assert len(healed) == 1, m1
    heal_step = healed[0]["healed_at_step"]
    alone = [m["step"] for m in m0 if m["replicas_live"] == 1]
    assert alone == list(range(KILL_AT, heal_step)) and len(alone) >= 2, alone
    assert all(m["global_batch_live"] == m0[0]["global_batch_live"] // 2 for m in m0 if m["replicas_live"] == 1)
    assert heal_step <= STEPS - 1 and healed[0]["join_quorums"] <= 4
    assert [m["step"] for m in m1] == list(range(KILL_AT)) + list(range(heal_step, STEPS))
    # the healed group's first step starts from the live group's parameters of that step, bit for bit (the heal
    # carried the parameters the forward reads: without stage 3's shards the end states below would still agree,
    # the groups' averaged gradient hides a stale forward)
    for r in range(2):
        first = results[2 + r]["snapshots"]
        assert min(first) == heal_step, sorted(first)
        live = results[r]["snapshots"][heal_step]
        assert all(torch.equal(first[heal_step][k], live[k]) for k in live)
    # every rank of group 1 equals the same rank of group 0, bit for bit: parameter shards (stage 3) or full
    # parameters, fp32 masters, Adam moments, the update count, and the full parameters gathered from the shards
    kinds = {n.split(":")[0] for n in results[0]["names"]}
    assert {"master", "exp_avg", "exp_avg_sq", "param"} <= kinds, kinds
    assert_healed_bitwise_and_nothing_lost(results, tmp_path, STEPS, KILL_AT, EVERY, before, lines_before, layout)
