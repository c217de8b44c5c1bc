"""ZeRO 1-2 launch the parameter all-gathers after the step and the next forward waits for each bucket where a
module needs it: every read of a parameter must come after its bucket's wait.

A lazy all-gather, whose data arrive only when it is waited for, turns a read before the wait from a rare race
(on gloo the gather usually lands first: CI saw it once, a zb_h1 run at dp 2 x pp 2 off by 1e-4 from step 4) into
a deterministic error. The case it caught: on the last pipeline stage the tied head is `wte.head(x)`, a method,
so the embedding's forward pre-hook never ran there and the head read the weight while half of it was the
other dp rank's old values. The model's own forward now waits for every parameter outside the blocks.
"""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_distributed
from parity_helpers import assert_same_training, train_run
from recipe_helpers import tiny_resolved

from megazoo.parallel.collectives import all_gather_flat
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero import stage12
from megazoo.recipes.training.trainer import Trainer


class _LazyGather:
    """An async all-gather that has not arrived yet: the output is written only at wait()."""

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, {**kwargs, "async_op": False}

    def wait(self) -> bool:
        if self.args is not None:
            all_gather_flat(*self.args, **self.kwargs)
            self.args = None
        return True


def _lazy_all_gather_flat(*args, async_op: bool = False, **kwargs):
    if not async_op:
        return all_gather_flat(*args, **kwargs)
    return _LazyGather(args, kwargs)


@functools.cache  # the same one-process run for every case
def _reference():
    return train_run(tiny_resolved(train={"micro_batch": 8}, model={"n_layer": 4}), Topology.solo())


@pytest.mark.parametrize("pp, schedule", [(1, "1f1b"), (2, "1f1b"), (2, "zb_h1")])
@pytest.mark.parametrize("stage", [1, 2])
def test_every_parameter_read_waits_for_its_all_gather(monkeypatch, pp, schedule, stage):
    monkeypatch.setattr(stage12, "all_gather_flat", _lazy_all_gather_flat)  # inherited by the forked ranks
    res = tiny_resolved(parallel={"dp": 2, "pp": pp, "schedule": schedule}, zero={"stage": stage},
                        model={"n_layer": 4}, train={"micro_batch": 2 if pp == 1 else 1, "grad_accum": 2 * pp})

    def work():
        trainer = Trainer(res, Topology.build(2, 1, pp))
        assert trainer.zero._prefetch  # the gathers are waited by the forward hooks, not in the step
        result = trainer.fit()
        return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                "params": trainer.full_state_dict()}

    ref = _reference()
    for got in run_distributed(work, res.world_size):
        assert_same_training(got, ref)
