"""checkpoint.async_save on one GPU: the snapshot goes through pinned host buffers (non-blocking copies, one
synchronize), the state keeps training on the device meanwhile, and the published files are byte-identical to a
sync save of the same state (the CPU suite checks the same on gloo: tests/parallel/checkpoint/test_checkpoint_async.py)."""

import dataclasses

import pytest
import torch
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.trainer import Trainer

pytestmark = pytest.mark.cuda


def test_async_save_on_cuda_matches_sync(tmp_path):
    res = tiny_resolved(train={"steps": 3, "precision": "fp32"}, zero={"stage": 1}, run={"dir": str(tmp_path / "a")},
                        kernels={"adamw": "torch"})
    trainer = Trainer(res, Topology.solo(torch.device("cuda", 0)))
    trainer.train_step(0)
    sync = trainer.save_checkpoint(1)
    recipe = res.recipe
    trainer.res = dataclasses.replace(res, recipe=dataclasses.replace(
        recipe, checkpoint=dataclasses.replace(recipe.checkpoint, async_save=True),
        run=dataclasses.replace(recipe.run, dir=str(tmp_path / "b"))))
    promised = trainer.save_checkpoint(1)
    trainer.train_step(1)  # the live state moves on while the writer runs: the snapshot must not
    published = checkpointing.async_saver(trainer).wait()
    assert promised == published
    assert (sync / "rank00000.pt").read_bytes() == (published / "rank00000.pt").read_bytes()
