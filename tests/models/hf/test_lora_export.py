"""Exporting a LoRA run: `megazoo convert megazoo-to-hf --merge-lora` writes a plain HF model whose logits equal
our LoRA model's, `--peft-adapter` writes the adapter alone in PEFT's format, which `peft.PeftModel.from_pretrained`
loads onto the HF base and which reproduces our logits; and `lora.adapter` imports such a folder to continue
training. The LoRA run is the real Trainer (fp64) started from a base checkpoint, its checkpoint holding adapters
only; comparisons in fp64 at 1e-10 where nothing is rounded to fp32, else 1e-5."""

from __future__ import annotations

import dataclasses

import peft
import pytest
import torch
import transformers
from recipe_helpers import tiny_recipe

from megazoo.models.hf.gpt2 import export_hf_dir
from megazoo.models.transformer import GPT
from megazoo.models.weights import full_state_dict, init_weights
from megazoo.parallel.checkpoint.consolidate import write_full_checkpoint
from megazoo.parallel.tensor.lora import is_lora_parameter
from megazoo.parallel.topology import Topology
from megazoo.recipes import cli
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.trainer import Trainer

V = 300
LORA = {"rank": 4, "alpha": 8.0, "targets": ["qkv", "o", "up", "down"]}
IDS = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(11))


def _trainer(root, steps, **lora):
    res = resolve(tiny_recipe(train={"steps": steps, "warmup_steps": 1, "lr": 3e-2}, lora={**LORA, **lora},
                              run={"dir": str(root / "run")},
                              checkpoint={"load": str(root / "base"), "at_end": True}))
    trainer = Trainer(res, Topology.solo())
    checkpointing.restore(trainer, report=lambda *_: None)
    return trainer


def _logits(trainer) -> torch.Tensor:
    trainer.model.eval()
    with torch.no_grad():
        return trainer.model(IDS)[..., :V]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-export")
    res = resolve(tiny_recipe())
    base = GPT(res.model, Topology.solo(), dtype=torch.float64)
    init_weights(base, seed=99)
    state = full_state_dict(base)
    write_full_checkpoint(state, dataclasses.asdict(res.model), root / "base")
    export_hf_dir(state, res.model, root / "hf-base")
    trainer = _trainer(root, 2)
    trainer.fit()
    adapters = {n: v for n, v in trainer.full_state_dict().items() if is_lora_parameter(n)}
    assert all(v.abs().max() > 0 for v in adapters.values())  # B moved off zero: the adapters do something
    return root, _logits(trainer), adapters


def _hf(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                             dtype=torch.float64).eval()


def test_merged_export_equals_our_lora_model(run):
    root, ours, _ = run
    assert cli.main(["convert", "megazoo-to-hf", str(root / "run" / "checkpoints"), "--merge-lora",
                     "--out", str(root / "merged")]) == 0
    with torch.no_grad():
        theirs = _hf(root / "merged")(IDS).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    with torch.no_grad():  # and the merge matters: the base alone computes something else
        assert (_hf(root / "hf-base")(IDS).logits - ours).abs().max() > 1e-3


def test_peft_adapter_loads_in_peft_and_reproduces_our_logits(run):
    root, ours, _ = run
    assert cli.main(["convert", "megazoo-to-hf", str(root / "run" / "checkpoints"), "--peft-adapter",
                     "--out", str(root / "adapter")]) == 0
    assert {p.name for p in (root / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    model = peft.PeftModel.from_pretrained(_hf(root / "hf-base"), str(root / "adapter")).eval()
    with torch.no_grad():
        theirs = model(IDS).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_peft_adapter_imports_to_continue_training(run, tmp_path):
    root, _, adapters = run
    if not (root / "adapter").exists():
        test_peft_adapter_loads_in_peft_and_reproduces_our_logits(run)
    (tmp_path / "base").symlink_to(root / "base")
    trainer = _trainer(tmp_path, 1, adapter=str(root / "adapter"))
    got = trainer.full_state_dict()
    for name, value in adapters.items():  # exports are fp32 (as every megazoo-to-hf export): exact after that
        torch.testing.assert_close(got[name], value.float().double(), rtol=0, atol=0, msg=name)
    trainer.fit()  # and it trains on from there


def test_lora_checkpoint_export_needs_a_lora_flag(run, capsys):
    root, _, _ = run
    assert cli.main(["convert", "megazoo-to-hf", str(root / "run" / "checkpoints"), "--out",
                     str(root / "plain")]) == 2
    assert "--merge-lora" in capsys.readouterr().err


def test_merge_lora_verify_scores_the_merged_export(run, tmp_path, capsys):
    """--merge-lora --verify runs the check (it used to return before it, exit 0 unverified)."""
    root, _, _ = run
    out_dir = tmp_path / "merged"
    assert cli.main(["convert", "megazoo-to-hf", str(root / "run" / "checkpoints"), "--out", str(out_dir),
                     "--merge-lora", "--verify", "--tokenizer", "none"]) == 0
    out = capsys.readouterr().out
    assert "logits (max abs difference)" in out and "FAIL" not in out and (out_dir / "config.json").is_file()


def test_merge_lora_verify_refuses_a_broken_export(run, tmp_path, capsys, monkeypatch):
    from megazoo.models.hf import gpt2

    root, _, _ = run
    real = gpt2._is_conv1d_weight  # one square Conv1D weight written without its transpose
    monkeypatch.setattr(gpt2, "_is_conv1d_weight", lambda name: real(name) and ".attn.c_proj." not in f".{name}")
    out_dir = tmp_path / "merged"
    assert cli.main(["convert", "megazoo-to-hf", str(root / "run" / "checkpoints"), "--out", str(out_dir),
                     "--merge-lora", "--verify", "--tokenizer", "none"]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "refused, nothing written to --out" in captured.err
    assert not out_dir.exists()


def test_recorded_lora_base_missing_names_it_and_lora_base(run, tmp_path, capsys, monkeypatch):
    """A LoRA run exported from another folder: the recorded base is named, and --lora-base suggested."""
    root, _, _ = run
    from megazoo.models.hf import convert_lora

    common, _ = convert_lora.lora_checkpoint(root / "run" / "checkpoints")
    recorded = {**common, "recipe": {**common["recipe"], "checkpoint": {"load": "runs/elsewhere/checkpoints"}}}
    monkeypatch.setattr(convert_lora, "lora_checkpoint",
                        lambda checkpoint: (recorded, convert_lora.lora_of_checkpoint(recorded)))
    assert cli.main(["convert", "megazoo-to-hf", str(root / "run" / "checkpoints"), "--out", str(tmp_path / "m"),
                     "--merge-lora", "--tokenizer", "none"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.load = 'runs/elsewhere/checkpoints'" in err and "--lora-base" in err
