"""Failures inside replica groups of 2 ranks (gloo, forked ranks, torchft's lighthouse a child process): one rank of
a group is SIGKILLed in the middle of a step; the test then plays torchrun (it ends the group's other rank) and the
launcher (it restarts the group). The other group never stops; the restarted group rejoins at its first quorums and
heals from the live one; after the heal every rank of every group holds bitwise the same parameters, fp32 masters,
Adam moments and update count. Inside a group: ZeRO-2 over dp 2, tp 2, pp 2; with ZeRO-2 and tp 2 the restarted
group is SIGKILLed again during its heal (applying the state; inside the transfer), and the next restart heals. Nothing a group wrote to disk before its failure is lost or overwritten."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


from ft_helpers import (assert_healed_bitwise_and_nothing_lost, end_group_after_a_death, finish, ft_sections,
                        lighthouse, metrics, published_files, start_ranks, wait_for)

pytest.importorskip("torchft")
STEPS = 14
KILL_AT = 4  # the step in whose middle rank 1 of group 1 dies
EVERY = 3  # periodic checkpoints: group 1 has published step_3 before it dies


def _alone(run_dir: Path) -> int:
    return sum(m["replicas_live"] == 1 for m in metrics(run_dir, 0))


LAYOUTS = {  # name: (parallel, zero, train) of the whole job; 2 replica groups of 2 ranks each
    "zero2-dp2": ({"dp": 4}, {"stage": 2}, {"micro_batch": 2}),
    "tp2": ({"dp": 2, "tp": 2}, {"stage": 1}, {}),
    "pp2": ({"dp": 2, "pp": 2}, {"stage": 1}, {"micro_batch": 2, "grad_accum": 2}),
}


@pytest.mark.parametrize("layout,heal_death", [("zero2-dp2", "heal"), ("tp2", "transfer"), ("pp2", None)])
def test_a_rank_killed_mid_step_its_group_rejoins_and_heals_bitwise(tmp_path, layout, heal_death):
    """heal_death: the first restart of the group dies again during its heal, while applying the received state
    ("heal") or inside torchft's transfer of it ("transfer"); the second restart heals."""
    kill_during_heal = heal_death is not None
    parallel, zero, train = LAYOUTS[layout]
    # keep every checkpoint (none rotated away); a restarted group's first quorum may wait for group 0 to finish a
    # held step on this loaded machine: 30 s before the lighthouse's quorum is given up (only failures wait)
    sections = ft_sections(tmp_path, STEPS, parallel=parallel, zero=zero, train=train,
                           checkpoint={"every": EVERY, "keep": STEPS}, fault_tolerance={"quorum_timeout_s": 30.0})
    outs = [[tmp_path / f"g{g}r{r}.pt" for r in range(2)] for g in range(2)]
    ready, first_ready = tmp_path / "restarted-group-is-up", tmp_path / "group-dying-in-its-heal-is-up"
    # group 0 waits (before a quorum, never between a quorum and its step) until each restarted group starts its
    # first quorum, so that it is still training when that group asks to join: from step KILL_AT + 2 for the one
    # that dies in its heal (it has the quorums up to STEPS - 6 to meet group 0 in), from STEPS - 5 for the last one
    # (see ft_helpers._hold)
    holds = [(KILL_AT + 2, first_ready)] * kill_during_heal + [(STEPS - 5, ready)]
    house = lighthouse()
    try:
        group0 = start_ranks(0, sections, house.address, outs[0], holds=holds)
        group1 = start_ranks(1, sections, house.address, outs[1], die=(1, "step", KILL_AT))
        end_group_after_a_death(group1, 1, 60)
        before = published_files(tmp_path, 1)
        lines_before = metrics(tmp_path, 1)
        # the launcher's restart takes seconds; meanwhile group 0's step counter keeps rising, alone
        wait_for(lambda: _alone(tmp_path) >= 2, 60, "group 0 to train 2 steps alone")
        if kill_during_heal:  # the restarted group dies during its heal (in the transfer, or applying the state)
            end_group_after_a_death(start_ranks(1, sections, house.address, outs[1], restarted=True,
                                                die=(0, heal_death, 0), joining=first_ready), 0, 60)
            # group 0 goes on: the step it shared with the dying group is not committed, and it trains that step
            # again with the live groups (itself) before the next restart is even started
            died = float(Path(str(outs[1][0]) + ".died").read_text())
            wait_for(lambda: any(m["time"] > died for m in metrics(tmp_path, 0)), 60,
                     "group 0 to go on after the failed heal")
            assert [m["replicas_live"] for m in metrics(tmp_path, 0) if m["time"] > died][:1] == [1]
        group1 = start_ranks(1, sections, house.address, outs[1], restarted=True, joining=ready)
        results = finish(group0 + group1, [o for pair in outs for o in pair])
    finally:
        house.stop()
    m0, m1 = metrics(tmp_path, 0), metrics(tmp_path, 1)
    # group 0 never stopped: every step once (none lost, no committed step redone), each committed
    assert [m["step"] for m in m0] == list(range(STEPS)) and all(m["committed"] for m in m0)
    healed = [m for m in m1 if "healed_at_step" in m]
    assert len(healed) == 1, m1
    heal_step = healed[0]["healed_at_step"]
    alone = [m["step"] for m in m0 if m["replicas_live"] == 1]
    assert alone == list(range(KILL_AT, heal_step)) and len(alone) >= 2 + kill_during_heal, alone
    assert all(m["global_batch_live"] == m0[0]["global_batch_live"] // 2 for m in m0 if m["replicas_live"] == 1)
    # rejoined within a bounded number of quorums once restarted; trains every step after the heal
    assert healed[0]["join_quorums"] <= 3 and heal_step < STEPS
    assert [m["step"] for m in m1] == list(range(KILL_AT)) + list(range(heal_step, STEPS))
    assert all(m["replicas_live"] == 2 for m in m0 + m1 if m["step"] >= heal_step)
    # every rank of group 1 equals the same rank of group 0, bit for bit; nothing on disk lost or overwritten
    assert_healed_bitwise_and_nothing_lost(results, tmp_path, STEPS, KILL_AT, EVERY, before, lines_before, layout)
