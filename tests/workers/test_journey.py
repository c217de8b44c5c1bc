"""README "Your own corpus, end to end", shortened and run through the real command line (subprocesses, as a
user types it): corpus -> tokenizer -> preprocess into a folder that does not exist yet -> dp=2 ZeRO-2 training
(vocabulary from the tokenizer, no torchrun banner, recipe.resolved.toml) -> resume with more steps (the log
says the schedule changed) -> export to Hugging Face -> generate. Evaluation is tested in tests/test_eval_*.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

RECIPE = """
[model]
preset = "gpt2-tiny"
n_layer = 2
dropout = 0.0
attn_dropout = 0.0

[parallel]
dp = 2

[zero]
stage = 2

[train]
steps = 4
micro_batch = 2
seq_len = 32
warmup_steps = 1
eval_batches = 1

[data]
source = "indexed"
paths = ["data/wiki"]
tokenizer = "tok/wiki.json"

[checkpoint]
every = 2

[run]
dir = "runs/wiki"

[logging]
progress = false

[sample]
tokens = 8
"""


def megazoo(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as a fresh shell has it
    done = subprocess.run([sys.executable, "-m", "megazoo.recipes.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"megazoo {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def test_your_own_corpus_end_to_end(tmp_path, data_dir):
    work = tmp_path / "journey"
    work.mkdir()
    lines = [line for line in (data_dir / "wikitext103" / "wiki.valid.tokens").read_text(encoding="utf-8")
             .splitlines()[:600] if line.strip()]
    with open(work / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i in range(0, len(lines), 4):
            f.write(json.dumps({"text": "\n".join(lines[i:i + 4])}) + "\n")
    (work / "my.toml").write_text(RECIPE, encoding="utf-8")

    megazoo(work, "tokenizer", "train", "--input", "corpus.jsonl", "--type", "bpe", "--vocab-size", "512",
            "--output", "tok/wiki.json")
    megazoo(work, "preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok/wiki.json", "--output-prefix",
            "data/wiki", "--workers", "2")  # data/ does not exist yet
    first = megazoo(work, "train", "my.toml")
    assert "OMP_NUM_THREADS" not in first.stderr  # no torchrun banner
    assert "vocab 512;" in first.stdout  # the tokenizer's vocabulary, not the preset's 50,257
    assert "\nsample:\n" in first.stdout  # the default empty prompt: a sample that starts a fresh document
    resolved = tomllib.loads((work / "runs/wiki/recipe.resolved.toml").read_text())
    assert resolved["model"]["vocab_size"] == 512 and resolved["train"]["global_batch"] == 4
    assert resolved["data"]["paths"] == [str(work / "data/wiki")]

    again = megazoo(work, "train", "my.toml", "--resume", "--set", "train.steps=6")
    assert "resumed from" in again.stdout and "step_00000004" in again.stdout
    assert "resuming with train.steps = 4 in the checkpoint, 6 now" in again.stdout
    assert (work / "runs/wiki/recipe.resolved.before-step_4.toml").is_file()
    assert tomllib.loads((work / "runs/wiki/recipe.resolved.toml").read_text())["train"]["steps"] == 6
    steps = [json.loads(line)["step"] for line in (work / "runs/wiki/metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == sorted(set(steps)) and max(steps) == 5  # one history, steps 0..5

    megazoo(work, "convert", "megazoo-to-hf", "runs/wiki/checkpoints", "--out", "hf-wiki")
    assert (work / "hf-wiki" / "config.json").is_file()
    out = megazoo(work, "generate", "runs/wiki/checkpoints", "--prompt", "The", "--max-new-tokens", "5")
    assert out.stdout.strip()


def test_workers_get_omp_threads_unless_the_user_set_them(monkeypatch):
    from megazoo.workers.supervisor import worker_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert worker_threads(2) == {"OMP_NUM_THREADS": str(max(1, cores // 2))}
    assert worker_threads(10 * cores) == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads(2) == {}  # the user's value reaches the workers unchanged
