"""The README's main command, end to end (shortened), and early failure of bad launches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo.toml"
DEMO_TP2 = REPO / "recipes" / "demo_tp2.toml"


def megazoo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megazoo.recipes.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("recipe, layout", [(DEMO, "dp=2 tp=1"), (DEMO_TP2, "dp=1 tp=2")], ids=["zero2", "tp2"])
def test_demo_runs_on_two_processes_and_loss_falls(tmp_path, recipe, layout):
    run_dir = tmp_path / "demo"
    out = megazoo("train", str(recipe), "--set", "train.steps=60", "--set", f"run.dir={run_dir}",
                  "--set", "data.max_bytes=1500000", "--set", "train.eval_every=30", "--set", "sample.tokens=12",
                  "--set", "train.warmup_steps=5")
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(60))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_bytes"):
        assert all(key in r for r in records), key
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.5, (first, last)  # ln(4096) = 8.3 at the start
    assert "val_loss" in records[29]
    assert layout in out.stdout and "validation loss" in out.stdout and "sample:" in out.stdout
    # The run leaves a checkpoint at its end (checkpoint.at_end) and says where.
    assert f"checkpoint: {run_dir / 'checkpoints' / 'step_00000060'}" in out.stdout
    assert f"loss curve: {run_dir / 'loss.png'}" in out.stdout and (run_dir / "loss.png").stat().st_size > 1000


def test_bad_recipe_fails_before_any_process_starts(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\npreset = "tnlg-17b"\n[parallel]\ntp = 8\n[data]\nsource = "synthetic"\n')
    out = megazoo("train", str(bad), timeout=60)
    assert out.returncode == 2
    assert "parallel.tp = 8" in out.stderr and "n_head = 28" in out.stderr
    assert "torch.distributed" not in out.stderr and not (tmp_path / "runs").exists()


def test_nproc_must_match_layout():
    out = megazoo("train", str(DEMO), "--nproc", "3", timeout=60)
    assert out.returncode == 2 and "dp=2 x tp=1 x pp=1 = 2 processes, but 3" in out.stderr


def test_unknown_override_key_fails():
    out = megazoo("train", str(DEMO), "--set", "train.stepz=3", timeout=60)
    assert out.returncode == 2 and "train.stepz" in out.stderr and "steps" in out.stderr


def test_presets_lists_exact_counts():
    out = megazoo("presets", timeout=60)
    assert out.returncode == 0 and "17,176,845,728" in out.stdout and "1,557,611,200" in out.stdout
    # which vocabulary each count assumes: the demo trains gpt2-tiny at its own 8,192-token BPE, not GPT-2's 50,257
    assert "   vocab " in out.stdout.splitlines()[0] and "50,257" in out.stdout
    assert "parameters at each preset's own vocabulary" in out.stdout
    # MoE presets: total and active (the weights one token uses), equal to transformers' (tests/models/moe/)
    assert "active (MoE)" in out.stdout.splitlines()[0]
    assert "30,532,122,624     3,353,032,704" in out.stdout and "46,702,792,704    12,879,925,248" in out.stdout


def test_version():
    out = megazoo("--version", timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("megazoo 0.")


# `megazoo --help` and every command's --help answer at once: no torch (3-5 s to import) before a command runs.
# Counted as modules loaded, not seconds (no wall-clock thresholds in tests).
HELP_COMMANDS = ["", "train", "presets", "recipes", "plan", "eval", "generate", "convert", "preprocess", "tokenizer",
                 "launch", "verify", "reproduce", "plot", "data"]
HEAVY = ("torch", "transformers", "matplotlib", "datasets", "lm_eval")


@pytest.mark.parametrize("command", HELP_COMMANDS, ids=lambda c: c or "megazoo")
def test_help_loads_no_torch(command):
    code = ("import contextlib, io, sys\nfrom megazoo.recipes.cli import main\n"
            f"argv = {[command] if command else []} + ['--help']\n"
            "out = io.StringIO()\nwith contextlib.redirect_stdout(out):\n"
            "    try:\n        main(argv)\n    except SystemExit as stop:\n        assert stop.code == 0, stop.code\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\nprint(out.getvalue().startswith('usage: megazoo'))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    loaded, printed = run.stdout.splitlines()
    assert loaded == "[]", f"megazoo {command} --help imports {loaded}"
    assert printed == "True"  # the help itself was printed


def test_the_listed_help_of_each_command_is_the_help_it_registers():
    """`megazoo --help` lists lazily loaded commands from recipes/cli.py's COMMANDS table; each line there must
    be the help its own module registers (built here with every module loaded)."""
    from megazoo.recipes.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    registered = {action.dest: action.help for action in sub._choices_actions}
    assert {name: text for name, (text, _) in COMMANDS.items()} == {name: registered[name] for name in COMMANDS}
    listed = build_parser("")  # stubs only
    stubs = next(a for a in listed._actions if a.dest == "command")
    assert set(stubs.choices) == set(sub.choices)  # the same commands, loaded or not


def test_a_command_runs_after_lazy_loading(capsys):
    from megazoo.recipes.cli import main

    assert main(["plan", "--params", "7.5e9", "--dp", "64", "--paper"]) == 0
    assert "Psi = 7,500,000,000 parameters" in capsys.readouterr().out


def test_the_demo_runs_again_without_flags_and_keeps_the_earlier_run(tmp_path):
    """`make demo` twice: the demo recipe starts over (run.existing = 'start_over'), saying so, and the earlier run
    moves beside it, nothing lost. A recipe without that key still refuses (exit 2, --resume or --overwrite)."""
    run_dir = tmp_path / "demo"
    sets = ["--set", "train.steps=2", "--set", f"run.dir={run_dir}", "--set", "parallel.dp=1",
            "--set", "data.max_bytes=150000", "--set", "sample.tokens=0", "--set", "train.eval_every=0",
            "--set", "train.seq_len=16", "--set", "data.vocab_size=512"]
    first = megazoo("train", "demo", *sets)
    assert first.returncode == 0, first.stderr[-2000:]
    again = megazoo("train", "demo", *sets)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "starting over (run.existing = 'start_over')" in again.stderr
    (old,) = tmp_path.glob("demo.old-*")
    assert (old / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").is_file()
    refused = megazoo("train", "demo", *sets, "--set", "run.existing=refuse")
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    bad = megazoo("train", "demo", *sets, "--set", "run.existing=replace")
    assert bad.returncode == 2 and "run.existing = 'replace' is invalid" in bad.stderr
