"""recipes/moe-demo.toml: the MoE demo resolves as shipped (8 experts, top-2, at dp 2 = ep 2) and, shortened to a
few dozen steps on a slice of its corpus, trains with its experts split over the two ranks: the loss falls well
below its start."""

from __future__ import annotations

from pathlib import Path

from harness import run_distributed

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "moe-demo.toml"


def test_moe_demo_resolves_as_shipped():
    res = resolve(load_recipe(RECIPE), world_size=2)
    cfg, par = res.model, res.recipe.parallel
    assert (par.dp, par.ep, res.world_size, res.global_batch) == (2, 2, 2, 16)
    assert (cfg.n_experts, cfg.moe_top_k, cfg.moe_d_ff * cfg.moe_top_k) == (8, 2, cfg.d_ff)
    assert all(cfg.moe_layer(i) for i in range(cfg.n_layer))


def _train(res):
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    losses = trainer.fit().losses
    moe = trainer.chunks[0].h["0"].mlp
    return losses, moe.dispatcher.local_experts


def test_moe_demo_trains_shortened(tmp_path):
    overrides = ["train.steps=30", "train.seq_len=64", "train.micro_batch=4", "train.eval_batches=1", "train.warmup_steps=5", "train.eval_every=0",
                 "data.max_bytes=300000", "data.val_fraction=0.2", f"run.dir={tmp_path / 'run'}", "sample.tokens=0",
                 "checkpoint.at_end=false", "logging.progress=false"]
    res = resolve(load_recipe(RECIPE, overrides), world_size=2)
    (losses, local0), (losses1, local1) = run_distributed(_train, 2, res)
    assert (local0, local1) == (range(0, 4), range(4, 8))  # each rank holds half of every layer's experts
    assert losses == losses1  # the step's loss is the mean over both ranks
    assert losses[-1] < losses[0] - 2.0, losses
