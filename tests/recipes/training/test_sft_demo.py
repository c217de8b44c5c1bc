"""The fine-tuning demo (recipes/sft-demo.toml, `make sft-demo`): `megazoo data sft-demo` builds its dataset from
a base checkpoint in one command, the shipped recipe trains it with LoRA through the real CLI, and the run prints
the base model's answer and the fine-tuned one, each stopped at the chat template's end of turn. Shortened: a
6-step base (tests/trained_tiny.py), a slice of the stdlib, 2 fine-tuning steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trained_tiny import train_tiny

from megazoo.data.sft.chat_template import BUILTIN_TEMPLATES, cut_at_end_of_turn, end_of_turn
from megazoo.recipes.cli import main as cli_main

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "sft-demo.toml"
PREFIX = "runs/sft-demo-data/sft/stdlib_sft"


def test_end_of_turn_is_read_from_the_template():
    assert end_of_turn(BUILTIN_TEMPLATES["chatml"]) == "<|im_end|>"
    assert end_of_turn(BUILTIN_TEMPLATES["llama3"]) == "<|eot_id|>"
    assert cut_at_end_of_turn("def f(x):<|im_end|>\n<|im_start|>user", "<|im_end|>") == ("def f(x):", True)
    assert cut_at_end_of_turn("def f(x", "<|im_end|>") == ("def f(x", False)


def test_sft_demo_trains_from_the_base_and_answers_before_and_after(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the recipe's paths are relative to where `megazoo train` runs
    train_tiny(tmp_path / "runs" / "demo")  # stands in for `make demo`: n_positions 64
    assert cli_main(["data", "sft-demo", "--checkpoint", "runs/demo/checkpoints", "--output-prefix", PREFIX,
                     "--seq-len", "64", "--max-bytes", "150000"]) == 0
    built = capsys.readouterr().out
    manifest = json.loads(Path(f"{PREFIX}.sft.json").read_text())
    assert manifest["template"] == "chatml" and manifest["seq_len"] == 64 and manifest["examples"] > 20
    assert f"{manifest['examples']:,} of {manifest['rows']:,} stdlib functions" in built
    # the rows left out are exactly those over the sequence length, each recorded, none truncated
    assert len(manifest["bad_rows"]) == manifest["rows"] - manifest["examples"]
    assert all("longer than the sequence length 64" in row["reason"] for row in manifest["bad_rows"])
    assert Path(f"{PREFIX}.tokenizer.json").is_file() and Path(f"{PREFIX}.jsonl").is_file()

    assert cli_main(["train", str(RECIPE), "--set", "parallel.dp=1", "--set", "train.steps=2",
                     "--set", "train.seq_len=64", "--set", "sample.tokens=6", "--set", "logging.progress=false"]) == 0
    out = capsys.readouterr().out
    assert "from checkpoint.load" in out
    before = out.split("sample before training:\n", 1)[1].split("\n", 1)[0]
    after = out.split("sample after training:\n", 1)[1].split("\ncheckpoint:", 1)[0]
    assert "<|im_end|>" not in before + after  # the answer alone: cut at the end-of-turn marker
    assert out.index("sample before training:") < out.index("train loss") < out.index("sample after training:")


def test_sft_demo_data_bad_input_names_the_value(tmp_path, capsys):
    prefix = str(tmp_path / "d")
    assert cli_main(["data", "sft-demo", "--checkpoint", str(tmp_path / "nope"), "--output-prefix", prefix]) == 2
    assert f"--checkpoint {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    assert cli_main(["data", "sft-demo", "--tokenizer", "x", "--output-prefix", prefix, "--seq-len", "0"]) == 2
    assert "--seq-len 0 is invalid: it must be a positive integer" in capsys.readouterr().err
    Path(f"{prefix}.bin").write_bytes(b"")
    assert cli_main(["data", "sft-demo", "--tokenizer", "x", "--output-prefix", prefix]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # the base (or its tokenizer) is required: argparse's exit 2
        cli_main(["data", "sft-demo", "--output-prefix", prefix])
    assert stop.value.code == 2 and "one of the arguments --checkpoint --tokenizer is required" in \
        capsys.readouterr().err
    assert not Path(f"{prefix}.jsonl").exists()  # nothing written by a refused command
