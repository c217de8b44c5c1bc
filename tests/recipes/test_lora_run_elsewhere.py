"""A LoRA fine-tuning run read where it was not written: the shipped sft-demo recipe trained (shortened) in one
folder, then, from another folder, `megazoo generate --chat` answers as the run's own closing sample did (its
adapters on the base its recipe recorded, relative to the folder it ran in; the chat template it trained with; the
answer stopped at the end of turn), `megazoo eval --checkpoint` and `eval harness` score it as its merged export
scores (through megazoo, and through lm-eval's hf model), `convert --merge-lora` finds the same base, and `megazoo train sft-demo` there says where checkpoint.load was looked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lm_eval_tasks import offline, write_tasks
from trained_tiny import train_tiny

from megazoo.recipes.cli import main as cli_main

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "sft-demo.toml"
PREFIX = "runs/sft-demo-data/sft/stdlib_sft"
PROMPT = "Return the square root of x."  # the recipe's [sample] prompt
# The run's closing sample is drawn (the tiny base answers greedily with blanks), seeded with train.seed
SAMPLING = ["--temperature", "1.0", "--top-k", "50", "--seed", "1234"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(folder the run was started in, another folder, the run's own answer after training)."""
    root = tmp_path_factory.mktemp("lora-elsewhere")
    work, other = root / "work", root / "other"
    other.mkdir()
    train_tiny(work / "runs" / "demo")  # stands in for `make demo`
    here = os.getcwd()
    os.chdir(work)  # the shipped recipe's paths are relative to where `megazoo train` runs
    try:
        assert cli_main(["data", "sft-demo", "--checkpoint", "runs/demo/checkpoints", "--output-prefix", PREFIX,
                         "--seq-len", "64", "--max-bytes", "150000"]) == 0
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["train", str(RECIPE), "--set", "parallel.dp=1", "--set", "train.steps=3",
                             "--set", "train.seq_len=64", "--set", "sample.tokens=8", "--set",
                             "sample.temperature=1.0", "--set", "sample.top_k=50", "--set",
                             "logging.progress=false"]) == 0
    finally:
        os.chdir(here)
    after = out.getvalue().split("sample after training:\n", 1)[1].split("\ncheckpoint:", 1)[0]
    assert after.strip(), out.getvalue()  # the run answered something
    return work, other, after


def test_generate_chat_from_another_folder_answers_as_the_run_did(run, monkeypatch, capsys):
    work, other, after = run
    monkeypatch.chdir(other)
    ckpts = str(work / "runs" / "sft-demo" / "checkpoints")
    capsys.readouterr()
    assert cli_main(["generate", ckpts, "--prompt", PROMPT, "--max-new-tokens", "8", "--chat", *SAMPLING]) == 0
    assert capsys.readouterr().out == after + "\n"
    # tp = 2 (torchrun): the workers get the base and the template resolved here, and print the same
    tp2 = subprocess.run([sys.executable, "-m", "megazoo.recipes.cli", "generate", ckpts, "--prompt", PROMPT,
                          "--max-new-tokens", "8", "--chat", *SAMPLING, "--tp", "2"],
                         capture_output=True, text=True, timeout=300)
    assert tp2.returncode == 0 and tp2.stdout == after + "\n", tp2.stderr
    # the template named instead of recorded: the same; the end-of-turn marker is never printed
    assert cli_main(["generate", ckpts, "--prompt", PROMPT, "--max-new-tokens", "40", "--chat", "chatml",
                     *SAMPLING]) == 0
    long = capsys.readouterr().out
    assert long.startswith(after) and "<|im_end|>" not in long
    # --lora-base names the base explicitly; a wrong one is refused naming what differs or is missing
    assert cli_main(["generate", ckpts, "--prompt", PROMPT, "--max-new-tokens", "8", "--chat", *SAMPLING,
                     "--lora-base", str(work / "runs" / "demo" / "checkpoints")]) == 0
    assert capsys.readouterr().out == after + "\n"
    assert cli_main(["generate", ckpts, "--prompt", PROMPT, "--max-new-tokens", "8", "--lora-base", "nope"]) == 2
    assert "--lora-base nope: no such checkpoint" in capsys.readouterr().err
    # a checkpoint of a run with no SFT dataset records no template: --chat says how to name one
    assert cli_main(["generate", str(work / "runs" / "demo" / "checkpoints"), "--prompt", PROMPT,
                     "--max-new-tokens", "2", "--chat"]) == 2
    assert "records no chat template" in capsys.readouterr().err


def test_eval_harness_and_merge_lora_from_another_folder(run, monkeypatch, data_dir, tmp_path):
    work, other, _ = run
    monkeypatch.chdir(other)
    ckpts = str(work / "runs" / "sft-demo" / "checkpoints")
    assert cli_main(["convert", "megazoo-to-hf", ckpts, "--merge-lora", "--out", str(other / "merged")]) == 0
    wiki = str(data_dir / "wikitext103" / "wiki.test.tokens")
    common = ["--data", wiki, "--limit", "3", "--stride", "32"]
    assert cli_main(["eval", "wikitext103", "--checkpoint", ckpts, *common, "--json", "lora.json"]) == 0
    assert cli_main(["eval", "wikitext103", "--hf", str(other / "merged"), *common, "--json", "merged.json"]) == 0
    base = str(work / "runs" / "demo" / "checkpoints")
    assert cli_main(["eval", "wikitext103", "--checkpoint", base, *common, "--json", "base.json"]) == 0
    lora, merged, base = (json.loads((other / f"{name}.json").read_text()) for name in ("lora", "merged", "base"))
    assert abs(lora["nll_sum"] / base["nll_sum"] - 1) > 1e-4  # the adapters change the scores: they were read
    assert lora["lora_base"] == str((work / "runs" / "demo" / "checkpoints").resolve() / "step_00000006")
    assert lora["num_scored_tokens"] == merged["num_scored_tokens"] > 0
    assert lora["nll_sum"] == pytest.approx(merged["nll_sum"], rel=1e-5)  # adapters attached vs merged: rounding
    # lm-eval through `megazoo eval harness` on the LoRA checkpoint = lm-eval's own hf model on the merged export
    offline()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    import megazoo.eval.harness_model  # noqa: F401  (registers "megazoo" with lm-eval)
    from lm_eval.tasks import TaskManager

    tasks = write_tasks(tmp_path / "lm-eval", data_dir)
    assert cli_main(["eval", "harness", "--checkpoint", ckpts, "--tasks", "mc_local", "--include-path", str(tasks),
                     "--bootstrap-iters", "0", "--json", "harness.json"]) == 0
    cli = json.loads((other / "harness.json").read_text())["mc_local"]
    common = dict(tasks=["mc_local"], bootstrap_iters=0, log_samples=True,
                  task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    ours = lm_eval.simple_evaluate(model="megazoo", model_args=f"checkpoint={ckpts}", batch_size=4, **common)
    theirs = lm_eval.simple_evaluate(model=HFLM(pretrained=str(other / "merged"), batch_size=4, device="cpu"),
                                     **common)
    pairs = list(zip(ours["samples"]["mc_local"], theirs["samples"]["mc_local"], strict=True))
    assert pairs
    for a, b in pairs:  # every choice's log-likelihood, to fp32 rounding
        for mine, hf in zip(a["resps"], b["resps"], strict=True):
            assert mine[0][0] == pytest.approx(hf[0][0], rel=1e-5, abs=1e-5), (mine, hf)
    assert cli["acc,none"] == ours["results"]["mc_local"]["acc,none"] == theirs["results"]["mc_local"]["acc,none"]


def test_shipped_recipe_from_another_folder_says_where_it_looked(run, monkeypatch, capsys):
    _, other, _ = run
    monkeypatch.chdir(other)
    assert cli_main(["train", "sft-demo"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.load = 'runs/demo/checkpoints' does not exist in the current folder {other}" in err
    assert "output of `megazoo train demo`" in err and "--set checkpoint.load=/path/to/runs/demo/checkpoints" in err
