"""Fault-tolerant replica groups on torchft (gloo, 2 groups of 1 rank, the lighthouse a child process): without a
failure they train what plain dp = 2 trains; a group SIGKILLed mid-run is dropped while the other never stops,
and once restarted it heals from the live group (not from disk) to bitwise-equal parameters and Adam state; the
lighthouse's death falls back to the normal restart path."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ft_helpers import finish, ft_sections, lighthouse, metrics, start_group, start_ranks, wait_for
from harness import run_distributed
from recipe_helpers import tiny_recipe

from megazoo.parallel.topology import Topology
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.replicated import FINISHED
from megazoo.recipes.training.trainer import Trainer

pytest.importorskip("torchft")
STEPS = 20


def _plain_dp(sections: dict) -> dict:
    trainer = Trainer(resolve(tiny_recipe(**sections)), Topology.build(dp=2))
    result = trainer.fit()
    return {"losses": result.losses, "tensors": [v.tensor.clone() for v in trainer.zero.state_views()]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Two groups, no failure: the run the failure tests are held to."""
    run_dir = tmp_path_factory.mktemp("ft-ref")
    house = lighthouse()
    try:
        sections = ft_sections(run_dir, STEPS)
        outs = [run_dir / f"out{g}.pt" for g in range(2)]
        procs = [start_group(g, sections, house.address, outs[g]) for g in range(2)]
        results = finish(procs, outs)
    finally:
        house.stop()
    return sections, results, [metrics(run_dir, g) for g in range(2)]


def test_without_failure_replica_groups_train_what_plain_dp_trains(reference):
    sections, (g0, g1), (m0, m1) = reference
    assert [m["step"] for m in m0] == list(range(STEPS)) and all(m["replicas_live"] == 2 for m in m0 + m1)
    assert all(m["global_batch_live"] == 8 and m["committed"] for m in m0)
    # every group ends with the same parameters, fp32 masters and Adam moments, bit for bit
    assert g0["names"] == g1["names"] and g0["optimizer_steps"] == g1["optimizer_steps"] == STEPS
    assert all(torch.equal(a, b) for a, b in zip(g0["tensors"], g1["tensors"]))
    plain_sections = {k: v for k, v in sections.items() if k not in ("fault_tolerance", "run")}
    plain = run_distributed(_plain_dp, 2, plain_sections)[0]
    # each group's loss is its half of the global batch: their mean is plain dp's loss (fp64: rounding only)
    for s, loss in enumerate(plain["losses"]):
        assert abs((g0["losses"][s] + g1["losses"][s]) / 2 - loss) < 1e-12, s
    assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(g0["tensors"], plain["tensors"]))


def test_a_killed_group_is_dropped_restarted_and_healed_from_the_live_one(reference, tmp_path, capfd):
    _, ref, (ref_m0, _) = reference
    house = lighthouse()
    ready = tmp_path / "restarted-group-is-up"
    try:  # group 0's first quorum after the kill waits for group 1's heartbeat to lapse: 30 s, not 3, on a loaded
        # machine (only a failure waits; the numbers are the reference's)
        sections = ft_sections(tmp_path, STEPS, fault_tolerance={"quorum_timeout_s": 30.0})
        outs = [tmp_path / f"out{g}.pt" for g in range(2)]
        procs = [start_group(0, sections, house.address, outs[0], hold=(STEPS - 8, ready), progress=True),
                 start_group(1, sections, house.address, outs[1])]
        wait_for(lambda: len(metrics(tmp_path, 1)) >= 3, 60, "group 1 to train 3 steps")
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join()
        # the launcher's restart takes seconds (torchrun, imports); here group 0 trains 3 steps alone meanwhile
        wait_for(lambda: sum(m["replicas_live"] == 1 for m in metrics(tmp_path, 0)) >= 3, 60, "group 0 alone")
        procs[1] = start_group(1, sections, house.address, outs[1], restarted=True, ready=ready)  # as the launcher
        g0, g1 = finish(procs, outs)
    finally:
        house.stop()
    m0, m1 = metrics(tmp_path, 0), metrics(tmp_path, 1)
    assert [m["step"] for m in m0] == list(range(STEPS))  # every step once: none redone, none lost
    bar = capfd.readouterr().err  # group 0's progress line shows the live replica groups as they change
    assert "train (group 0)" in bar and "live=2/2" in bar and "live=1/2" in bar
    healed = [m for m in m1 if "healed_at_step" in m]
    assert len(healed) == 1, m1
    heal_step = healed[0]["healed_at_step"]
    # while group 1 was down group 0 went on alone, every step, on its half of the batch (the metrics say so)
    alone = [m for m in m0 if m["replicas_live"] == 1]
    killed_at = alone[0]["step"]
    assert [m["step"] for m in alone] == list(range(killed_at, heal_step)) and len(alone) >= 3
    assert all(m["global_batch_live"] == 4 and m["committed"] for m in alone)
    # the restarted group was let in at its first quorums (bounded: no waiting for a checkpoint or a restart)
    assert killed_at < heal_step < STEPS and healed[0]["join_quorums"] <= 3
    # group 1's lines before the kill are kept (nothing on disk lost); after the heal it trains every step
    before = [m["step"] for m in m1 if m["step"] < heal_step]
    assert before == list(range(len(before))) and len(before) >= 3
    assert [m["step"] for m in m1 if m["step"] >= heal_step] == list(range(heal_step, STEPS))
    assert all(m["replicas_live"] == 2 for m in m0 + m1 if m["step"] >= heal_step)
    # healed from the live peer: every parameter, Adam moment and the update count bitwise equal at the end
    assert g0["optimizer_steps"] == g1["optimizer_steps"] == STEPS
    assert all(torch.equal(a, b) for a, b in zip(g0["tensors"], g1["tensors"]))
    # the loss curve: bit for bit the failure-free run's before the failure (same quorums, same sums); after it,
    # within what the steps on half the batch explain: measured, 11 of 24 steps alone cost 0.31 in validation
    # loss on this machine (21% fewer samples in the steepest part of the curve); 0.5 leaves room, a wrong
    # average (e.g. divided by the configured 2 groups while 1 was live) or a lost update goes far beyond it
    for ref_line, line in zip(ref_m0, m0):
        if line["step"] < killed_at:
            assert line["loss"] == ref_line["loss"], line["step"]
        assert abs(line["loss"] - ref_line["loss"]) < LOSS_TOLERANCE, (line["step"], line["loss"], ref_line["loss"])
    assert abs(g0["val_loss"] - ref[0]["val_loss"]) < LOSS_TOLERANCE
    assert g0["val_loss"] < m0[0]["loss"] - 0.3  # and it still learned


LOSS_TOLERANCE = 0.5


def test_lighthouse_death_falls_back_to_the_normal_restart_path(reference, tmp_path):
    """The lighthouse dies: each group saves its last committed step and stops with a clear error; the normal
    restart path (a new lighthouse, every group resuming from its own checkpoint) ends exactly as the failure-free
    run, and nothing on disk is lost."""
    _, reference, reference_metrics = reference
    run_dir = tmp_path / "run"
    sections = ft_sections(run_dir, STEPS)
    outs = [tmp_path / f"out{g}.pt" for g in range(2)]
    house, procs = _run(sections, outs)
    try:
        wait_for(lambda: len(metrics(run_dir, 0)) >= 4, 60, "4 steps")
    finally:
        house.stop()  # SIGKILL: the lighthouse dies mid-run
    for p in procs:
        p.join(60)
    lost = [torch.load(o, weights_only=False) for o in outs]
    assert [r.get("kind") for r in lost] == ["LighthouseGone", "LighthouseGone"], lost
    assert "no quorum from the lighthouse at http" in lost[0]["error"]
    saved = [sorted(p.name for p in (run_dir / f"group-{g}" / "checkpoints").glob("step_*")) for g in range(2)]
    assert saved[0] == saved[1] and len(saved[0]) == 1, saved  # both saved the same last committed step
    step = int(saved[0][0].split("_")[1])
    assert 4 <= step < STEPS and [m["step"] for m in metrics(run_dir, 0)] == list(range(step))

    # the normal restart path: a new lighthouse, every group resumes from its checkpoint
    outs = [tmp_path / f"again{g}.pt" for g in range(2)]
    house, procs = _run(sections, outs, resume=True)
    try:
        g0, g1 = finish(procs, outs)
    finally:
        house.stop()
    for g in range(2):  # one clean history per group: every step once, the lines before the death kept
        assert [m["step"] for m in metrics(run_dir, g)] == list(range(STEPS))
    # the run is the failure-free one, bit for bit: parameters, Adam moments, update count, losses
    for got, want in zip((g0, g1), reference):
        assert got["optimizer_steps"] == want["optimizer_steps"] == STEPS
        assert all(torch.equal(a, b) for a, b in zip(got["tensors"], want["tensors"]))
    assert [m["loss"] for m in metrics(run_dir, 0)] == [m["loss"] for m in reference_metrics[0]]


def _run(sections, outs, resume=False):
    house = lighthouse()
    try:
        return house, [start_group(g, sections, house.address, outs[g], resume=resume) for g in range(2)]
    except BaseException:
        house.stop()
        raise


def _plain_full(sections: dict) -> dict:
    trainer = Trainer(resolve(tiny_recipe(**sections)), Topology.build(dp=4))
    return {"losses": trainer.fit().losses, "full": trainer.full_state_dict()}


def test_groups_of_two_zero2_ranks_train_what_plain_zero2_dp4_trains(tmp_path):
    """HSDP's two dimensions: ZeRO-2 shards over each group's 2 ranks, the 2 groups are the replicas; the owned
    gradient chunks are averaged across groups through torchft. Same losses and weights as ZeRO-2 over dp 4."""
    steps = 4
    sections = ft_sections(tmp_path, steps, parallel={"dp": 4}, zero={"stage": 2}, train={"micro_batch": 2})
    house = lighthouse()
    outs = [[tmp_path / f"g{g}r{r}.pt" for r in range(2)] for g in range(2)]
    try:
        procs = [p for g in range(2) for p in start_ranks(g, sections, house.address, outs[g])]
        results = finish(procs, [o for pair in outs for o in pair])
    finally:
        house.stop()
    plain_sections = {k: v for k, v in sections.items() if k not in ("fault_tolerance", "run")}
    plain = run_distributed(_plain_full, 4, plain_sections)[0]
    g0, g1 = results[0], results[2]  # each group's rank 0: the group's loss (its half of the global batch)
    for s, loss in enumerate(plain["losses"]):
        assert abs((g0["losses"][s] + g1["losses"][s]) / 2 - loss) < 1e-12, s
    for result in results:  # every rank of every group holds the same full weights as plain ZeRO-2 over dp 4
        for name, value in plain["full"].items():
            assert torch.allclose(result["full"][name], value, rtol=0, atol=1e-12), name


def test_a_group_restarted_after_the_run_finished_does_not_train_alone(reference, tmp_path):
    """The others finished (their marker says train.steps): a restarted group stops at its first quorum with
    NoLiveGroup instead of waiting start_timeout_s (set to 10 minutes here) or training from step 0 alone."""
    sections = ft_sections(tmp_path, STEPS, fault_tolerance={"start_timeout_s": 600.0})
    (tmp_path / FINISHED).write_text(str(STEPS))
    house = lighthouse()
    try:
        out = tmp_path / "out1.pt"
        proc = start_group(1, sections, house.address, out, restarted=True)
        proc.join(120)
        assert not proc.is_alive()
    finally:
        house.stop()
    result = torch.load(out, weights_only=False)
    assert result.get("kind") == "NoLiveGroup" and "found no live group to heal from" in result["error"]
    assert metrics(tmp_path, 1) == []
