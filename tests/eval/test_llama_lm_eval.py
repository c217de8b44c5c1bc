"""lm-eval through `megazoo eval harness` on the Llama-style demo (recipes/llama-demo.toml: rotary, RMSNorm,
SwiGLU, grouped-query attention, untied head), trained briefly here at tp 1 on its stdlib corpus: the adapter's
per-sample log-likelihoods on the shipped local tasks (tests/lm_eval_tasks.py) equal lm-eval's own `hf` model
(transformers' LlamaForCausalLM) on the exported weights, to 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_eval_tasks import offline, write_tasks

from megazoo.parallel.topology import Topology
from megazoo.recipes.cli import main as megazoo_cli
from megazoo.recipes.config import load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "llama-demo.toml"
TASKS = ["lambada_openai", "mc_local"]


def _close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def test_llama_demo_harness_equals_lm_evals_hf_model(tmp_path, data_dir):
    offline()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import megazoo.eval.harness_model  # noqa: F401  (registers "megazoo" with lm-eval)

    run = tmp_path / "run"
    overrides = ["parallel.tp=1", "train.steps=4", "train.seq_len=64", "train.micro_batch=4", "train.eval_every=0",
                 "train.precision=fp32", "data.max_bytes=300000", "data.val_fraction=0.2", f"run.dir={run}",
                 "sample.tokens=0", "checkpoint.at_end=true", "logging.progress=false"]
    Trainer(resolve(load_recipe(RECIPE, overrides)), Topology.solo()).fit()
    ckpts = run / "checkpoints"
    tasks = write_tasks(tmp_path / "lm-eval", data_dir)
    assert megazoo_cli(["convert", "megazoo-to-hf", str(ckpts), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    common = dict(tasks=TASKS, task_manager=manager, log_samples=True, bootstrap_iters=0)
    hf = lm_eval.simple_evaluate(model=HFLM(pretrained=str(tmp_path / "hf"), batch_size=4, device="cpu"), **common)
    ours = lm_eval.simple_evaluate(model="megazoo", model_args=f"checkpoint={ckpts}", batch_size=4, **common)
    for task in TASKS:
        assert len(ours["samples"][task]) == len(hf["samples"][task]) > 0
        for a, b in zip(ours["samples"][task], hf["samples"][task]):
            for mine, theirs in zip(a["resps"], b["resps"]):
                assert _close(mine[0][0], theirs[0][0]) and mine[0][1] == theirs[0][1], (task, mine, theirs)
        assert ours["results"][task]["acc,none"] == pytest.approx(hf["results"][task]["acc,none"], rel=1e-6)
    # the CLI on the same checkpoint: lm-eval's table and the JSON of its results
    out = tmp_path / "harness.json"
    assert megazoo_cli(["eval", "harness", "--checkpoint", str(ckpts), "--tasks", "mc_local", "--include-path",
                        str(tasks), "--bootstrap-iters", "0", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["mc_local"]["acc,none"] == pytest.approx(ours["results"]["mc_local"]["acc,none"])
