"""recipes/llama-demo.toml: the Llama-style demo resolves as shipped (llama-tiny at tp 2) and, shortened to a
few dozen steps on a slice of its corpus, trains: the loss falls well below its start on both tp ranks."""

from __future__ import annotations

from pathlib import Path

from harness import run_distributed

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "llama-demo.toml"


def test_llama_demo_resolves_as_shipped():
    res = resolve(load_recipe(RECIPE), world_size=2)
    cfg = res.model
    assert (res.recipe.model.preset, res.recipe.parallel.tp, res.world_size) == ("llama-tiny", 2, 2)
    assert (cfg.norm, cfg.positions, cfg.mlp, cfg.n_kv_head, cfg.tie_embeddings) == ("rmsnorm", "rotary", "swiglu",
                                                                                    2, False)
    assert cfg.vocab_size == 4096 and res.global_batch == 16


def test_llama_demo_trains_shortened(tmp_path):
    overrides = ["train.steps=40", "train.seq_len=64", "train.warmup_steps=5", "train.eval_every=0",
                 "data.max_bytes=300000", "data.val_fraction=0.2", f"run.dir={tmp_path / 'run'}", "sample.tokens=0",
                 "checkpoint.at_end=false", "logging.progress=false"]
    res = resolve(load_recipe(RECIPE, overrides), world_size=2)
    losses = run_distributed(lambda: Trainer(res, Topology.build(dp=1, tp=2)).fit().losses, 2)
    assert losses[0] == losses[1]  # both tp ranks see the same loss
    assert losses[0][-1] < losses[0][0] - 2.0, losses[0]
