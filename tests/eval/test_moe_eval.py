"""Evaluating an MoE checkpoint trained at ep 2: a tiny Qwen3-MoE (4 experts, top-2, both layers MoE) trained two
steps by the real Trainer at dp 2 = ep 2 (each rank holds two experts of every layer; the checkpoint reshards them),
exported by `megazoo convert megazoo-to-hf`, then scored against lm-eval's own `hf` model (transformers'
Qwen3MoeForCausalLM) on the exported folder, on the local tasks of tests/lm_eval_tasks.py:

  * `megazoo eval harness` / the "megazoo" lm-eval model: every per-sample log-likelihood to 1e-5, accuracies equal;
  * `megazoo eval lambada|wikitext103 --protocol lm-eval`: lm-eval's lambada_openai accuracy and perplexity and
    wikitext word perplexity (1e-6 relative);
  * `--protocol megatron` (the default): the checkpoint through megazoo's GPT equals the exported folder through
    transformers (`--hf DIR --backend transformers`) on the same windows and examples;
  * at ep 2 (each rank holding two of the four experts, reading only its own from the checkpoint): `megazoo eval
    harness --ep 2` under torchrun, and both protocols' eval run as the torchrun workers run it (two forked ranks
    calling the workers' `evaluate` with their Topology), give the same numbers against lm-eval's hf model.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys

import pytest
from harness import run_distributed
from lm_eval_tasks import offline, write_tasks
from recipe_helpers import TINY

from megazoo.parallel.topology import Topology
from megazoo.recipes.cli import main as megazoo_cli
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

offline()
TASKS = ["lambada_openai", "wikitext", "mc_local", "gen_local"]
MOE = {"preset": "qwen3-moe-tiny", "n_layer": 2, "vocab_size": 4096, "n_positions": 64, "n_experts": 4,
       "moe_dense_layers": [], "moe_aux_loss_coef": 0.01, "dropout": 0.0, "attn_dropout": 0.0}


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import megazoo.eval.harness_model  # noqa: F401  (registers "megazoo" with lm-eval)

    root = tmp_path_factory.mktemp("moe-eval")
    table = copy.deepcopy(TINY)
    table["model"] = MOE
    table["parallel"] = {"dp": 2, "ep": 2}
    table["train"].update(steps=2, precision="fp32", seq_len=32, eval_every=0)
    table["data"] = {"source": "stdlib", "vocab_size": 4096, "max_bytes": 300_000, "val_fraction": 0.2}
    table.update(run={"dir": str(root / "run")}, checkpoint={"at_end": True}, sample={"tokens": 0})
    res = resolve(from_dict(Recipe, table))
    assert res.recipe.parallel.ep == 2 and res.world_size == 2
    run_distributed(lambda: Trainer(res, Topology.of(res.recipe.parallel)).fit() and None, 2)
    ckpts = root / "run" / "checkpoints"
    assert megazoo_cli(["convert", "megazoo-to-hf", str(ckpts), "--out", str(root / "hf")]) == 0
    assert json.loads((root / "hf" / "config.json").read_text())["model_type"] == "qwen3_moe"
    tasks = write_tasks(root, data_dir)
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    common = dict(tasks=TASKS, task_manager=manager, log_samples=True, bootstrap_iters=0)
    hf = lm_eval.simple_evaluate(model=HFLM(pretrained=str(root / "hf"), batch_size=4, device="cpu"), **common)
    ours = lm_eval.simple_evaluate(model="megazoo", model_args=f"checkpoint={ckpts}", batch_size=4, **common)
    return {"root": root, "ckpts": ckpts, "tasks": tasks, "hf": hf, "ours": ours}


def test_harness_equals_lm_evals_hf_model_on_the_export(setup, tmp_path):
    hf, ours = setup["hf"], setup["ours"]
    for task in TASKS:
        assert len(ours["samples"][task]) == len(hf["samples"][task]) > 0
        for a, b in zip(ours["samples"][task], hf["samples"][task]):
            for mine, theirs in zip(a["resps"], b["resps"]):
                if task == "gen_local":  # greedy text
                    assert mine == theirs
                elif task == "wikitext":  # a page's summed log-likelihood
                    assert close(mine[0], theirs[0]), (task, mine, theirs)
                else:
                    assert close(mine[0][0], theirs[0][0]) and mine[0][1] == theirs[0][1], (task, mine, theirs)
    for task, metric in (("lambada_openai", "acc,none"), ("mc_local", "acc,none"), ("wikitext", "word_perplexity,none")):
        assert ours["results"][task][metric] == pytest.approx(hf["results"][task][metric], rel=1e-6)
    out = tmp_path / "harness.json"  # the CLI on the same checkpoint
    assert megazoo_cli(["eval", "harness", "--checkpoint", str(setup["ckpts"]), "--tasks", "mc_local", "--include-path",
                    str(setup["tasks"]), "--bootstrap-iters", "0", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["mc_local"]["acc,none"] == pytest.approx(hf["results"]["mc_local"]["acc,none"])


def _eval(task: str, source: list[str], data, out, *extra) -> dict:
    assert megazoo_cli(["eval", task, *source, "--data", str(data), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_lm_eval_protocol_equals_lm_eval(setup, tmp_path):
    ckpt, root, hf = ["--checkpoint", str(setup["ckpts"])], setup["root"], setup["hf"]["results"]
    lambada = _eval("lambada", ckpt, root / "lambada_slice.jsonl", tmp_path / "l.json", "--protocol", "lm-eval")
    assert lambada["accuracy"] == hf["lambada_openai"]["acc,none"]
    assert lambada["ppl"] == pytest.approx(hf["lambada_openai"]["perplexity,none"], rel=1e-6)
    wiki = _eval("wikitext103", ckpt, root / "wiki_slice.raw", tmp_path / "w.json", "--protocol", "lm-eval")
    assert wiki["word_perplexity"] == pytest.approx(hf["wikitext"]["word_perplexity,none"], rel=1e-6)


@pytest.mark.parametrize("task, data", [("lambada", "lambada_slice.jsonl"), ("wikitext103", "wiki_slice.raw")])
def test_megatron_protocol_equals_transformers_on_the_export(setup, tmp_path, task, data):
    root = setup["root"]
    ours = _eval(task, ["--checkpoint", str(setup["ckpts"])], root / data, tmp_path / "ours.json")
    theirs = _eval(task, ["--hf", str(root / "hf"), "--backend", "transformers"], root / data,
                   tmp_path / "theirs.json")
    assert ours["protocol"] == theirs["protocol"] == "megatron"
    key = "ppl"
    assert ours[key] == pytest.approx(theirs[key], rel=1e-5)
    if task == "lambada":
        assert ours["accuracy"] == theirs["accuracy"]


def test_harness_at_ep2_equals_lm_evals_hf_model(setup, tmp_path):
    """`megazoo eval harness --ep 2` (torchrun, two workers each holding two experts; rank 0 drives lm-eval and the
    other rank runs every forward, the generate_until task's cached ones included) == lm-eval's hf model."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "megazoo.recipes.cli", "eval", "harness", "--checkpoint",
                          str(setup["ckpts"]), "--tasks", ",".join(TASKS), "--include-path", str(setup["tasks"]),
                          "--bootstrap-iters", "0", "--batch-size", "4", "--ep", "2", "--output-path", str(out),
                          "--log-samples"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("lambada_openai") == 1  # lm-eval's table, printed once (rank 0)
    hf = setup["hf"]
    for task in TASKS:
        mine = [json.loads(line) for line in (out / f"samples_{task}.jsonl").read_text().splitlines()]
        assert [m["doc_id"] for m in mine] == [t["doc_id"] for t in hf["samples"][task]]
        for a, b in zip(mine, hf["samples"][task]):
            for ours, theirs in zip(a["resps"], b["resps"]):
                if task == "gen_local":
                    assert ours == theirs
                elif task == "wikitext":
                    assert close(ours[0], theirs[0]), (task, ours, theirs)
                else:
                    assert close(ours[0][0], theirs[0][0]) and ours[0][1] == theirs[0][1], (task, ours, theirs)
    results = json.loads((out / "results.json").read_text())["results"]
    for task, metric in (("lambada_openai", "acc,none"), ("mc_local", "acc,none"), ("gen_local", "exact_match,none"),
                         ("wikitext", "word_perplexity,none")):
        assert results[task][metric] == pytest.approx(hf["results"][task][metric], rel=1e-6)


def _workers_eval(argv: list[str], ep: int) -> list[dict]:
    """`megazoo eval ARGV --ep EP` as its torchrun workers run it: each of EP forked ranks calls the workers'
    `evaluate` with the Topology they build (workers/local.tp_worker); returns every rank's result."""
    from megazoo.eval.cli import evaluate, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", *argv, "--ep", str(ep)])
    return run_distributed(lambda: evaluate(args, Topology.build(dp=ep, tp=1, ep=ep)), ep)


def test_both_protocols_at_ep2_equal_lm_eval_and_transformers(setup, tmp_path):
    root, hf = setup["root"], setup["hf"]["results"]
    ckpt = ["--checkpoint", str(setup["ckpts"])]
    lambada = _workers_eval(["lambada", *ckpt, "--data", str(root / "lambada_slice.jsonl"), "--protocol", "lm-eval"], 2)
    wiki = _workers_eval(["wikitext103", *ckpt, "--data", str(root / "wiki_slice.raw"), "--protocol", "lm-eval"], 2)
    for rank in range(2):  # every rank scored every example: the same numbers on both
        assert lambada[rank]["ep"] == 2 and lambada[rank]["accuracy"] == hf["lambada_openai"]["acc,none"]
        assert lambada[rank]["ppl"] == pytest.approx(hf["lambada_openai"]["perplexity,none"], rel=1e-6)
        assert wiki[rank]["word_perplexity"] == pytest.approx(hf["wikitext"]["word_perplexity,none"], rel=1e-6)
    for task, data in (("lambada", "lambada_slice.jsonl"), ("wikitext103", "wiki_slice.raw")):
        ours = _workers_eval([task, *ckpt, "--data", str(root / data)], 2)[0]
        theirs = _eval(task, ["--hf", str(root / "hf"), "--backend", "transformers"], root / data,
                       tmp_path / f"{task}.json")
        assert ours["protocol"] == "megatron" and ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-5)
        if task == "lambada":
            assert ours["accuracy"] == theirs["accuracy"]
