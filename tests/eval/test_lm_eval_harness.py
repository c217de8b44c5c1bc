"""The lm-eval adapter (`megazoo eval harness`, the "megazoo" lm-eval model) == lm-eval's own `hf` model on the
exported weights, offline, on local copies of lambada_openai and wikitext, a multiple-choice and a generate_until
task: every per-sample log-likelihood to 1e-5 (relative for page sums above 1), aggregates to 1e-6 relative,
the same greedy generations; tp=2 (torchrun, sharded load) == tp=1; bad input is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from lm_eval_tasks import TASKS, lm_eval_reference, offline

from megazoo.recipes.cli import main as megazoo

offline()  # nothing may reach for the hub

METRICS = {"lambada_openai": ("acc,none", "perplexity,none"),
           "wikitext": ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"),
           "mc_local": ("acc,none", "acc_norm,none"), "gen_local": ("exact_match,none",)}


def close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    return lm_eval_reference(tmp_path_factory, data_dir)


def test_every_sample_matches_lm_evals_hf_model(setup):
    hf, ours = setup["hf"]["samples"], setup["ours"]["samples"]
    for task in TASKS:
        assert len(ours[task]) == len(hf[task]) > 0
        for a, b in zip(ours[task], hf[task]):
            assert a["doc_id"] == b["doc_id"]
            for mine, theirs in zip(a["resps"], b["resps"]):
                if task == "gen_local":
                    assert mine == theirs  # greedy text, cut at "\n\n"
                elif task == "wikitext":  # a page's summed log-likelihood
                    assert close(mine[0], theirs[0], 1e-5), (task, a["doc_id"], mine, theirs)
                else:
                    assert close(mine[0][0], theirs[0][0], 1e-5) and mine[0][1] == theirs[0][1], (task, mine, theirs)


def test_aggregates_match_lm_evals_hf_model(setup):
    for task, metrics in METRICS.items():
        for metric in metrics:
            mine, theirs = setup["ours"]["results"][task][metric], setup["hf"]["results"][task][metric]
            assert mine == pytest.approx(theirs, rel=1e-6), (task, metric)


def test_cli_tp2_equals_tp1_and_writes_lm_evals_results(setup, tmp_path, capsys):
    args = ["eval", "harness", "--checkpoint", str(setup["ckpts"]), "--tasks", "lambada_openai,wikitext",
            "--include-path", str(setup["tasks"]), "--bootstrap-iters", "0", "--batch-size", "4"]
    tp2 = subprocess.run([sys.executable, "-m", "megazoo.recipes.cli", *args, "--tp", "2", "--json",
                          str(tmp_path / "tp2.json")], capture_output=True, text=True, timeout=600)
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    assert "lambada_openai" in tp2.stdout and "word_perplexity" in tp2.stdout  # lm-eval's table, once (rank 0)
    results = json.loads((tmp_path / "tp2.json").read_text())
    assert set(results) == {"lambada_openai", "wikitext"}
    for task in results:
        for metric in METRICS[task]:
            assert results[task][metric] == pytest.approx(setup["ours"]["results"][task][metric], rel=1e-6)
    # tp=1 in this process, with --limit: lm-eval's results object for the first 2 documents
    assert megazoo([*args[:5], "lambada_openai", *args[6:], "--limit", "2", "--json", str(tmp_path / "tp1.json")]) == 0
    limited = json.loads((tmp_path / "tp1.json").read_text())["lambada_openai"]
    assert limited["sample_len"] == 2
    first_two = [s["resps"][0][0][0] for s in setup["ours"]["samples"]["lambada_openai"][:2]]
    assert limited["perplexity,none"] == pytest.approx(2.718281828459045 ** (-sum(first_two) / 2), rel=1e-6)


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "no_such_task"], "Tasks not found: no_such_task"),
    (["--tasks", "lambada_openai", "--tp", "3"], "--tp 3 must be a positive divisor"),
    (["--tasks", "lambada_openai", "--limit", "0"], "--limit 0 is invalid"),
    (["--tasks", "lambada_openai", "--limit", "2.5"], "--limit 2.5 is invalid"),
    (["--tasks", "lambada_openai", "--gen-kwargs", "temperature"], "'temperature' is not KEY=VALUE"),
    (["--tasks", "lambada_openai", "--log-samples"], "--log-samples needs --output-path DIR"),
    (["--tasks", "lambada_openai", "--num-fewshot", "-1"], "--num-fewshot -1 is invalid"),
])
def test_bad_input_is_one_line_and_exit_2(setup, capsys, extra, message):
    args = ["eval", "harness", "--checkpoint", str(setup["ckpts"]), "--include-path", str(setup["tasks"]), *extra]
    assert megazoo(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_lm_evals_own_flags_fraction_fewshot_seed_and_samples(setup, tmp_path):
    """--limit as a fraction, --num-fewshot, --seed, --gen-kwargs and --output-path with --log-samples, as lm-eval
    takes them: half of the local LAMBADA slice, its samples written one JSON line each."""
    out = tmp_path / "out"
    args = ["eval", "harness", "--checkpoint", str(setup["ckpts"]), "--tasks", "lambada_openai",
            "--include-path", str(setup["tasks"]), "--bootstrap-iters", "0", "--limit", "0.5", "--num-fewshot", "0",
            "--seed", "7", "--gen-kwargs", "temperature=0", "--output-path", str(out), "--log-samples"]
    assert megazoo(args) == 0
    results = json.loads((out / "results.json").read_text())
    everything = len(setup["ours"]["samples"]["lambada_openai"])
    half = results["results"]["lambada_openai"]["sample_len"]
    assert half == int(everything * 0.5) > 0 and results["n-shot"]["lambada_openai"] == 0
    lines = (out / "samples_lambada_openai.jsonl").read_text().splitlines()
    assert len(lines) == half and {"doc_id", "resps"} <= set(json.loads(lines[0]))
    assert megazoo(args) == 2  # the folder holds results now: nothing is overwritten


def test_without_lm_eval_the_error_names_the_extra(setup, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    assert megazoo(["eval", "harness", "--checkpoint", str(setup["ckpts"]), "--tasks", "lambada_openai"]) == 2
    err = capsys.readouterr().err
    assert "megazoo[eval]" in err and err.count("\n") == 1


class _Ids:
    """A tokenizer of space-separated integers (ids < 97): enough for the adapter's generate_until."""

    eod_id = 0

    def encode(self, text):
        return [int(w) for w in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


def _tiny_adapter():
    import torch

    from megazoo.eval.harness_model import MegazooLM
    from megazoo.models.presets import get_preset
    from megazoo.models.transformer import GPT
    from megazoo.models.weights import init_weights
    from megazoo.parallel.topology import Topology

    cfg = get_preset("gpt2-tiny").replace(vocab_size=97, dropout=0.0, attn_dropout=0.0, n_layer=1, n_positions=16)
    model = GPT(cfg, Topology.solo(), dtype=torch.float64)
    init_weights(model, 5)
    return MegazooLM.from_parts(model.eval(), _Ids())


def test_max_gen_toks_at_or_past_the_context_is_refused_and_truncation_is_said(caplog):
    """max_gen_toks >= the context kept 1 prompt token silently; lm-eval's hf model refuses it, and warns when a
    prompt is cut to fit."""
    from lm_eval.api.instance import Instance

    lm = _tiny_adapter()
    long_prompt = " ".join(str(i % 90 + 1) for i in range(14))
    with pytest.raises(ValueError, match="max_gen_toks = 16 leaves no room for the prompt in the model's 16-token"):
        lm.generate_until([Instance("generate_until", {}, (long_prompt, {"max_gen_toks": 16}), 0)])
    with caplog.at_level("WARNING"):
        out = lm.generate_until([Instance("generate_until", {}, (long_prompt, {"max_gen_toks": 4, "until": []}), 0)])
    assert len(out) == 1
    assert "Left truncation applied. Original sequence length was 14, truncating to last 12 tokens" in caplog.text


def test_lm_evals_own_command_line_runs_the_megazoo_model(setup, tmp_path):
    """`megazoo-lm-eval --model megazoo ...` (eval/lm_eval_main.py): lm-eval's CLI, our model registered; the
    first two LAMBADA documents score as the adapter scores them in-process."""
    out = subprocess.run([sys.executable, "-m", "megazoo.eval.lm_eval_main", "--model", "megazoo", "--model_args",
                          f"checkpoint={setup['ckpts']}", "--tasks", "lambada_openai", "--include_path",
                          str(setup["tasks"]), "--limit", "2", "--output_path",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lambada_openai" in out.stdout and "perplexity" in out.stdout
    (result,) = (tmp_path / "out").rglob("results_*.json")
    limited = json.loads(result.read_text())["results"]["lambada_openai"]
    first_two = [s["resps"][0][0][0] for s in setup["ours"]["samples"]["lambada_openai"][:2]]
    assert limited["perplexity,none"] == pytest.approx(2.718281828459045 ** (-sum(first_two) / 2), rel=1e-6)
