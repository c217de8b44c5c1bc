"""A LoRA run's weights: the frozen base comes from checkpoint.load (any ZeRO stage, ZeRO-3's partitions
included), its checkpoints hold only the adapters, and resuming is exact (same losses and parameters as the run
that never stopped, with LoRA dropout on, so the random streams must resume too)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from recipe_helpers import tiny_recipe

from megazoo.models.transformer import GPT
from megazoo.models.weights import full_state_dict, init_weights
from megazoo.parallel.checkpoint.consolidate import write_full_checkpoint
from megazoo.parallel.checkpoint.io import read_common
from megazoo.parallel.tensor.lora import is_lora_parameter
from megazoo.parallel.topology import Topology
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.trainer import Trainer

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["qkv", "o", "up", "down"]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base checkpoint whose weights differ from what the LoRA run's own seed would initialise."""
    res = resolve(tiny_recipe())
    model = GPT(res.model, Topology.solo(), dtype=torch.float64)
    init_weights(model, seed=99)
    state = full_state_dict(model)
    out = tmp_path_factory.mktemp("base")
    write_full_checkpoint(state, dataclasses.asdict(res.model), out)
    return out, state


def _trainer(base_dir, run_dir, stage, steps, **checkpoint):
    res = resolve(tiny_recipe(train={"steps": steps, "warmup_steps": 1, "lr": 1e-2}, zero={"stage": stage},
                              lora=LORA, run={"dir": str(run_dir)},
                              checkpoint={"load": str(base_dir), **checkpoint}))
    trainer = Trainer(res, Topology.solo())
    return trainer, checkpointing.restore(trainer, report=lambda *_: None)


@pytest.mark.parametrize("stage", [1, 3])
def test_base_from_load_and_exact_resume(base, tmp_path, stage):
    base_dir, base_state = base
    whole, start = _trainer(base_dir, tmp_path / "whole", stage, 3)
    loaded = whole.full_state_dict()
    for name, value in base_state.items():  # the base is the loaded checkpoint's, not the seed's
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    expected = whole.fit(start_step=start)
    final = whole.full_state_dict()

    first, start = _trainer(base_dir, tmp_path / "run", stage, 2, at_end=True)
    assert start == 0
    first.fit(start_step=start)
    saved = read_common(first.save_checkpoint(2))
    manifest = (tmp_path / "run" / "checkpoints").glob("step_*/manifest.json")
    names = {p["name"] for m in manifest for p in json.loads(m.read_text())["pieces"]}
    assert names and all(is_lora_parameter(n) for n in names)  # only the adapters are saved
    assert saved["step"] == 2

    resumed, start = _trainer(base_dir, tmp_path / "run", stage, 3, resume=True)
    assert start == 2
    result = resumed.fit(start_step=start)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(expected.losses[2:]), rtol=0, atol=0)
    got = resumed.full_state_dict()
    for name, value in final.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
