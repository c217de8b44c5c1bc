"""Stragglers: every rank's compute and wait seconds in the step's metrics (gathered in the one metrics all-reduce),
and a rank persistently slower than the median by fault_tolerance.straggler_factor named with its host."""

from __future__ import annotations

import socket
import time

import torch.distributed as dist

from harness import run_distributed
from recipe_helpers import tiny_recipe

from megazoo.parallel.fault_tolerance.stragglers import StragglerWatch
from megazoo.parallel.topology import Topology
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer


def test_a_rank_is_named_once_it_was_slow_for_the_configured_steps_in_a_row():
    watch = StragglerWatch(factor=2.0, steps=3, hosts=["a", "b", "c", "d"])
    slow = [0.1, 0.1, 0.5, 0.1]
    assert watch.observe(0, slow) == [] and watch.observe(1, slow) == []
    (report,) = watch.observe(2, slow)
    assert report.startswith("straggler: rank 2 (host c) computed step 2 in 0.500 s, 5.0x the median 0.100 s of 4")
    assert watch.observe(3, slow) == []  # once per streak
    watch.observe(4, [0.1] * 4)  # back within the factor: the streak ends
    assert watch.observe(5, slow) == [] and watch.observe(6, slow) == [] and len(watch.observe(7, slow)) == 1
    # slower, but within the factor of the median, is no straggler
    assert all(StragglerWatch(2.0, 1, ["h"] * 4).observe(s, [0.1, 0.1, 0.19, 0.1]) == [] for s in range(3))


def _slow_rank(sleep_s: float) -> tuple[list[dict], list[str]]:
    res = resolve(tiny_recipe(parallel={"dp": 3}, train={"micro_batch": 1},
                              fault_tolerance={"straggler_factor": 2.0, "straggler_steps": 2}))
    topo = Topology.build(dp=3)
    gathers, gather = [], dist.all_gather_object  # object gathers (host names): when do they run?
    dist.all_gather_object = lambda *a, **k: (gathers.append("build"), gather(*a, **k))[1]
    trainer = Trainer(res, topo)
    if topo.rank == 2:  # this rank's forward and backward take sleep_s longer
        run = trainer.engine.run
        trainer.engine.run = lambda *a, **k: (time.sleep(sleep_s), run(*a, **k))[1]
    dist.all_gather_object = lambda *a, **k: (gathers.append("step"), gather(*a, **k))[1]
    return [trainer.train_step(step) for step in range(3)], gathers


def test_a_slow_rank_is_measured_and_named_with_its_host():
    Trainer(resolve(tiny_recipe()), Topology.solo())  # first build here (lazy imports, corpus): not per rank
    steps, gathers = run_distributed(_slow_rank, 3, 1.0)[0]  # rank 0's metrics: it writes metrics.jsonl
    assert gathers == ["build"]  # the host names are gathered once, never in a step (no host sync per step)
    for m in steps:
        compute, wait = m["rank_compute_s"], m["rank_wait_s"]
        assert len(compute) == len(wait) == 3
        assert compute[2] > 1.0 and all(c < compute[2] - 0.5 for c in compute[:2])
        # the others waited for it in the gradient all-reduce; it did not wait for them
        assert all(w > wait[2] + 0.5 for w in wait[:2])
    assert "stragglers" not in steps[0]  # one slow step is not yet a straggler (straggler_steps = 2)
    (named,) = steps[1]["stragglers"]
    assert named.startswith(f"straggler: rank 2 (host {socket.gethostname()}) computed step 1 in ")
    assert "stragglers" not in steps[2]  # named once per streak
