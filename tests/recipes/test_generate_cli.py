"""`megazoo generate` on a checkpoint written by training: the tokenizer comes from the checkpoint, greedy text
equals the argmax loop's, EOS ends the text, tp=2 (torchrun) prints what tp=1 prints, bad input exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trained_tiny import VOCAB, trained_checkpoints

from megazoo.data.tokenizers.store import checkpoint_tokenizer
from megazoo.models.generation.generate import full_logits
from megazoo.models.loading import load_gpt, open_checkpoint
from megazoo.parallel.checkpoint.io import read_common
from megazoo.parallel.topology import Topology
from megazoo.recipes.cli import main as megazoo

PROMPT = "def main(args):\n    "


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return trained_checkpoints(tmp_path_factory)


def _argmax_text(ckpt_dir, prompt, new, eos_stops=True):
    ckpt = open_checkpoint(ckpt_dir)
    model = load_gpt(ckpt, Topology.solo())
    ids = ckpt.tokenizer.encode(prompt)
    start = len(ids)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(full_logits(model, torch.tensor([ids[-ckpt.cfg.n_positions:]]))[0, -1].argmax()))
            if eos_stops and ids[-1] == ckpt.tokenizer.eod_id:
                ids.pop()
                break
    return ckpt.tokenizer.decode(ids[start:])


def test_checkpoint_records_its_tokenizer(ckpts):
    ckpt = open_checkpoint(ckpts)
    assert ckpt.tokenizer.vocab_size == VOCAB == ckpt.cfg.vocab_size and ckpt.step == 6
    common = read_common(ckpt.path)
    assert common["tokenizer"]["kind"] == "tokenizers-bpe"
    # A checkpoint from before the record: the demo corpus's tokenizer cached in run.dir is found instead.
    older = checkpoint_tokenizer({k: v for k, v in common.items() if k != "tokenizer"}, ckpt.path)
    assert older.encode(PROMPT) == ckpt.tokenizer.encode(PROMPT)


def test_generate_greedy_prints_the_argmax_continuation(ckpts, capsys):
    assert megazoo(["generate", str(ckpts), "--prompt", PROMPT, "--max-new-tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert out == _argmax_text(ckpts, PROMPT, 20) + "\n"
    # a step directory works as well as the checkpoints folder; sampling is seeded
    step = sorted(ckpts.glob("step_*"))[-1]
    args = ["generate", str(step), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0.9",
            "--top-k", "50", "--top-p", "0.9", "--seed", "3"]
    assert megazoo(args) == 0 and megazoo(args) == 0
    first, second = capsys.readouterr().out.split("\n")[:2]
    assert first == second


def test_generation_stops_at_eos(ckpts, capsys, monkeypatch):
    # Make EOS the argmax after the prompt: the continuation ends there, the mark itself not printed.
    import megazoo.models.generation.generate as generation

    ckpt = open_checkpoint(ckpts)
    eos = ckpt.tokenizer.eod_id
    real = generation.full_logits
    calls = []

    def eos_on_third(model, ids, cache=None):
        logits = real(model, ids, cache)
        calls.append(1)
        if len(calls) == 3:
            logits[..., eos] = 1e9
        return logits

    monkeypatch.setattr(generation, "full_logits", eos_on_third)
    assert megazoo(["generate", str(ckpts), "--prompt", PROMPT, "--max-new-tokens", "20"]) == 0
    assert len(calls) == 3
    assert capsys.readouterr().out == _argmax_text(ckpts, PROMPT, 2) + "\n"


def test_generate_tp2_prints_what_tp1_prints(ckpts):
    cmd = [sys.executable, "-m", "megazoo.recipes.cli", "generate", str(ckpts), "--prompt", PROMPT,
           "--max-new-tokens", "10"]
    tp2 = subprocess.run(cmd + ["--tp", "2"], capture_output=True, text=True, timeout=300)
    assert tp2.returncode == 0, tp2.stderr
    assert tp2.stdout == _argmax_text(ckpts, PROMPT, 10) + "\n"


@pytest.mark.parametrize("extra, message", [
    (["--tp", "3"], "--tp 3 must be a positive divisor"),
    (["--temperature", "-1"], "temperature -1.0 is invalid"),
    (["--top-p", "0"], "top_p 0.0 is invalid"),
    (["--max-new-tokens", "-4"], "--max-new-tokens -4 is invalid"),
    (["--tokenizer", "nowhere/tok.json"], "nowhere/tok.json"),
])
def test_bad_input_exits_2_with_one_line(ckpts, capsys, extra, message):
    args = ["generate", str(ckpts), "--prompt", PROMPT, "--max-new-tokens", "5", *extra]
    if "--max-new-tokens" in extra:
        args = ["generate", str(ckpts), "--prompt", PROMPT, *extra]
    assert megazoo(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_folder_without_checkpoints_is_refused(tmp_path, capsys):
    assert megazoo(["generate", str(tmp_path), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    assert "not a megazoo checkpoint" in capsys.readouterr().err


def _copy_with_a_damaged_newer(ckpts: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run's checkpoints/ with a newer step directory (named by `latest`) whose weights are damaged."""
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(ckpts, root)
    good = sorted(root.glob("step_*"))[-1]
    newer = root / f"step_{int(good.name.split('_')[1]) + 1:08d}"
    shutil.copytree(good, newer)
    weights = next(p for p in sorted(newer.iterdir()) if p.name.startswith("rank"))
    weights.write_bytes(weights.read_bytes()[:-7] + b"damaged")  # same size, other bytes: the sha256 differs
    (root / "latest").write_text(newer.name)
    return root, good


def test_a_damaged_latest_checkpoint_is_never_used_silently(ckpts, tmp_path, capsys):
    root, good = _copy_with_a_damaged_newer(ckpts, tmp_path)
    assert megazoo(["generate", str(root), "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert captured.out == _argmax_text(good, PROMPT, 6) + "\n"  # the older, good checkpoint decoded
    assert "skipping checkpoint" in captured.err and "is corrupt" in captured.err
    assert f"using checkpoint {good.resolve()}" in captured.err


def test_tp2_refuses_a_checkpoint_missing_a_shard_before_any_worker_starts(ckpts, tmp_path, capsys, monkeypatch):
    import shutil

    step = tmp_path / "step"
    shutil.copytree(sorted(ckpts.glob("step_*"))[-1], step)
    shard = next(p for p in sorted(step.iterdir()) if p.name.startswith("rank"))
    shard.unlink()
    import megazoo.workers.supervisor as supervisor
    monkeypatch.setattr(supervisor, "launch_local", lambda *a, **k: pytest.fail("workers were started"))
    assert megazoo(["generate", str(step), "--prompt", PROMPT, "--max-new-tokens", "3", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file {shard} is missing" in err and err.count("\n") == 1
