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
    return {"root": root, "moe": root / "moe", "dense": root / "dense", "bpe": data_dir / "gpt2_bpe",
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


@pytest.mark.parametrize("model, ep, fragments", [
    ("moe", 3, ("--ep 3", "n_experts = 4", "valid: 1, 2, 4")),
    ("moe", 0, ("--ep 0", "positive integer")),
    ("dense", 2, ("--ep 2", "mixture-of-experts", "n_experts = 0")),
])
def test_bad_ep_is_refused_before_any_worker(paths, capsys, model, ep, fragments):
    source = ["--checkpoint", paths["moe"], "--tokenizer", paths["bpe"]] if model == "moe" else ["--hf", paths["dense"]]
    assert megazoo(["eval", "lambada", *source, "--data", paths["lambada"], "--limit", 2, "--ep", ep]) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, err
    assert "rank" not in err  # the launcher's own check, not a worker's
