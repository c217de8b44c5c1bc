"""recipes/deepseek-demo.toml: the DeepSeek-V3-style demo resolves as shipped (sigmoid + bias routing over 8 experts
in 4 groups at dp 2 = ep 2, one shared expert, the first layer dense, one MTP module) and, shortened to a few dozen
steps on a slice of its corpus, trains: the loss (the main one plus 0.3 x the MTP one) falls well below its start
and the routing bias moves. Its checkpoint then decodes with `megazoo generate --speculative`: the same text as
plain greedy `megazoo generate`, with the drafts accepted per step printed."""

from __future__ import annotations

from pathlib import Path

from harness import run_distributed

from megazoo.parallel.topology import Topology
from megazoo.recipes.cli import main as megazoo
from megazoo.recipes.config import load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "deepseek-demo.toml"


def test_deepseek_demo_resolves_as_shipped():
    res = resolve(load_recipe(RECIPE), world_size=2)
    cfg, par = res.model, res.recipe.parallel
    assert (par.dp, par.ep, res.world_size, res.global_batch) == (2, 2, 2, 16)
    assert (cfg.n_experts, cfg.moe_top_k, cfg.moe_router, cfg.moe_n_group, cfg.moe_topk_group) == \
        (8, 2, "sigmoid_bias", 4, 2)
    assert (cfg.mtp_depth, cfg.mtp_loss_weight, cfg.moe_shared_experts) == (1, 0.3, 1)
    assert [cfg.moe_layer(i) for i in range(cfg.n_layer + cfg.mtp_depth)] == [False, True, True, True, True]


def _train(res):
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    losses = trainer.fit().losses
    bias = trainer.chunks[0].h["1"].mlp.router.expert_bias
    return losses, float(bias.abs().max())


def test_deepseek_demo_trains_shortened_and_drafts(tmp_path, capsys):
    overrides = ["train.steps=24", "train.seq_len=32", "train.micro_batch=4", "train.eval_batches=1",
                 "train.warmup_steps=5", "train.eval_every=0", "data.max_bytes=150000", "data.val_fraction=0.2",
                 f"run.dir={tmp_path / 'run'}", "sample.tokens=0", "checkpoint.at_end=true", "logging.progress=false",
                 "model.moe_bias_update_rate=0.01"]
    res = resolve(load_recipe(RECIPE, overrides), world_size=2)
    (losses, bias0), (losses1, bias1) = run_distributed(_train, 2, res)
    assert losses == losses1 and bias0 == bias1 > 0  # the bias moved, the same on both ranks
    assert losses[-1] < losses[0] - 2.0, losses
    ckpt = str(tmp_path / "run" / "checkpoints")
    capsys.readouterr()
    assert megazoo(["generate", ckpt, "--prompt", "def ", "--max-new-tokens", "12"]) == 0
    plain = capsys.readouterr().out
    assert megazoo(["generate", ckpt, "--prompt", "def ", "--max-new-tokens", "12", "--speculative"]) == 0
    text, report = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    assert text + "\n" == plain
    assert report.startswith("speculative: ") and "drafts accepted per step: " in report, report
    accepted = report.rsplit(": ", 1)[1].split()
    assert accepted and set(accepted) <= {"0", "1"}
