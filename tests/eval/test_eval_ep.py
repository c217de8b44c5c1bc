"""`megazoo eval --ep N` on an MoE model: the routed experts split over N torchrun workers (each reads only its
own experts from the checkpoint), every one scoring the same batches, gives what one process gives; bad --ep
values are refused before any worker starts (exit 2, one line naming the flag, the value and what is valid)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

from cli_helpers import megazoo


@pytest.fixture(scope="module")
def paths(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_ep")
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=50257, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False)
    MixtralForCausalLM(cfg).save_pretrained(str(root / "moe_hf"))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64)).save_pretrained(str(root / "dense"))
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copy(data_dir / "gpt2_bpe" / name, root / "moe_hf" / name)
        shutil.copy(data_dir / "gpt2_bpe" / name, root / "dense" / name)
    assert megazoo(["convert", "hf-to-megazoo", root / "moe_hf", "--out", root / "moe"]) == 0
    assert megazoo(["convert", "hf-to-megazoo", root / "dense", "--out", root / "dense_ckpt"]) == 0
    return {"root": root, "moe": root / "moe", "dense": root / "dense", "dense_ckpt": root / "dense_ckpt",
            "bpe": data_dir / "gpt2_bpe",
            "lambada": data_dir / "lambada" / "lambada_test.jsonl"}


def test_ep2_equals_ep1(paths):
    root = paths["root"]
    common = ["eval", "lambada", "--checkpoint", paths["moe"], "--tokenizer", paths["bpe"], "--data",
              paths["lambada"], "--limit", 6, "--batch-size", 3]
    assert megazoo(common + ["--json", root / "ep1.json"]) == 0
    assert megazoo(common + ["--ep", 2, "--json", root / "ep2.json"]) == 0
    ep1, ep2 = (json.loads((root / f"ep{n}.json").read_text()) for n in (1, 2))
    assert (ep1["ep"], ep2["ep"]) == (1, 2)
    assert ep2["nll_sum"] == pytest.approx(ep1["nll_sum"], rel=1e-6)
    assert ep2["num_correct"] == ep1["num_correct"] and ep2["num_examples"] == ep1["num_examples"] == 6


def _command(command: str, source: list) -> list:
    """The command line of `command` (eval, harness or generate) on `source`, --ep to follow."""
    if command == "harness":
        return ["eval", "harness", *source, "--tasks", "lambada_openai"]
    if command == "generate":
        return ["generate", *source, "--prompt", "The", "--max-new-tokens", 2]
    return ["eval", "lambada", *source, "--data", DATA, "--limit", 2]


DATA = "LAMBADA"  # replaced by the data file in the test


@pytest.mark.parametrize("command", ["eval", "harness", "generate"])
@pytest.mark.parametrize("model, ep, fragments", [
    ("moe", 3, ("--ep 3", "n_experts = 4", "valid: 1, 2, 4")),
    ("moe", 0, ("--ep 0", "positive integer")),
    ("dense", 2, ("--ep 2", "mixture-of-experts", "n_experts = 0")),
])
def test_bad_ep_is_refused_before_any_worker(paths, capsys, monkeypatch, command, model, ep, fragments):
    """eval, eval harness and generate refuse a bad --ep alike, in this process: no worker is started."""
    import megazoo.workers.supervisor as supervisor
    from megazoo.recipes.cli import main

    monkeypatch.setattr(supervisor, "launch_local", lambda *a, **k: pytest.fail("workers were started"))
    source = {"moe": ["--checkpoint", paths["moe"], "--tokenizer", paths["bpe"]],
              "dense": ["--checkpoint", paths["dense_ckpt"], "--tokenizer", paths["bpe"]]}[model]
    if command == "generate":
        source = [source[1], *source[2:]]  # generate takes the checkpoint as its argument
    argv = [paths["lambada"] if a == DATA else a for a in _command(command, source)]
    assert main([str(a) for a in [*argv, "--ep", ep]]) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, err
    assert "rank" not in err and err.count("\n") == 1  # one line, the launcher's own check, not a worker's


def test_ep_with_the_transformers_backend_is_refused(paths, capsys):
    assert megazoo(["eval", "lambada", "--hf", paths["root"] / "moe_hf", "--backend", "transformers", "--data",
                    paths["lambada"], "--limit", 2, "--ep", 2]) == 2
    err = capsys.readouterr().err
    assert "--backend transformers runs in one process: use --ep 1 (not 2)" in err, err
