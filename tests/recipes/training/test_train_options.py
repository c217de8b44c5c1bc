"""Training options beyond parity: bf16 autocast, activation checkpointing, wandb offline logging."""

from __future__ import annotations

import json

import pytest
import torch
from recipe_helpers import TINY, tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import resolve
from megazoo.recipes.train import run
from megazoo.recipes.training.trainer import Trainer


def _losses(**train):
    return Trainer(tiny_resolved(train={"steps": 5, **train}), Topology.solo()).fit().losses


def test_bf16_autocast_tracks_fp32():
    fp32, bf16 = _losses(precision="fp32"), _losses(precision="bf16")
    assert all(torch.isfinite(torch.tensor(bf16)))
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=2e-2, atol=0)
    assert bf16 != fp32  # autocast really changed the arithmetic


def test_activation_checkpointing_gives_the_same_training():
    assert _losses(activation_checkpointing=True) == _losses(activation_checkpointing=False)


def test_wandb_offline_logging_and_metrics_file(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    table = {**TINY, "train": {**TINY["train"], "steps": 3}, "run": {"dir": str(tmp_path)},
             "logging": {"progress": False, "wandb": "offline"}}
    run(resolve(from_dict(Recipe, table)), Topology.solo())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb wrote no offline run"


def test_the_run_log_names_a_llama_models_own_kernels(tmp_path, capsys):
    """The log's kernels: lines (recipes/train.py) follow the model: llama-tiny runs RMSNorm and SwiGLU, so the
    lines say so and name no LayerNorm or bias-GELU (they used to list GPT-2's ops for every model)."""
    table = {**TINY, "model": {"preset": "llama-tiny", "n_layer": 1, "vocab_size": 300},
             "train": {**TINY["train"], "steps": 1}, "run": {"dir": str(tmp_path)}, "sample": {"tokens": 0}}
    run(resolve(from_dict(Recipe, table)), Topology.solo())
    kernels = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("kernels: ")]
    assert kernels == ["rms_norm", "attention", "swiglu", "cross_entropy", "adamw"]


def test_validation_smaller_than_dp_is_refused_by_name():
    """Trainer.evaluate gives each dp rank its own validation samples: with fewer samples than ranks the last
    ranks would index past the end (found evaluating an MoE run at ep 2); refused up front with what is valid."""
    from types import SimpleNamespace

    from megazoo.data.token_dataset import TokenSamples
    from megazoo.recipes.config import RecipeError
    from megazoo.recipes.training.data_setup import check_validation_split

    one_sample = TokenSamples(torch.arange(9), 8)
    assert len(one_sample) == 1
    check_validation_split(one_sample, SimpleNamespace(dp=1))
    check_validation_split(None, SimpleNamespace(dp=4))
    with pytest.raises(RecipeError, match=r"holds 1 sample\(s\), fewer than the 2 data-parallel ranks.*at least 2"):
        check_validation_split(one_sample, SimpleNamespace(dp=2))
