"""`megazoo eval ... --hf DIR` reads every family `megazoo convert` reads (models/hf/families.py): on a tiny random
HF Llama, Qwen2 and Mistral folder, --hf scores exactly what --checkpoint scores on the folder `megazoo convert
hf-to-megazoo` made of it (same weights, same tokenizer, same code), in both protocols, and transformers' own
model (--backend transformers) scores the same to rounding."""

from __future__ import annotations

import json

import pytest
from hf_helpers import save_family_dir

from cli_helpers import megazoo

# (task, protocol): each task in one protocol per family here keeps the test short; every pair is in the GPT-2 tests
CASES = {"llama": [("wikitext103", "megatron"), ("lambada", "lm-eval")],
         "qwen2": [("lambada", "megatron"), ("wikitext103", "lm-eval")],
         "mistral": [("wikitext103", "megatron"), ("lambada", "lm-eval")]}


def _score(source: list, task: str, protocol: str, data_dir, out) -> dict:
    data = data_dir / ("wikitext103/wiki.test.tokens" if task == "wikitext103" else "lambada/lambada_test.jsonl")
    extra = ["--stride", 16] if protocol == "megatron" and task == "wikitext103" else []
    limit = 1 if (task, protocol) == ("wikitext103", "lm-eval") else 3  # lm-eval's pages are long: one
    assert megazoo(["eval", task, *source, "--data", data, "--limit", limit, "--protocol", protocol, *extra,
                    "--json", out]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", sorted(CASES))
def test_hf_equals_checkpoint_of_the_converted_folder(family, tmp_path, data_dir):
    hf, ckpt = save_family_dir(family, tmp_path / "hf"), tmp_path / "ckpt"
    assert megazoo(["convert", "hf-to-megazoo", hf, "--out", ckpt]) == 0
    for task, protocol in CASES[family]:
        ours = _score(["--hf", hf], task, protocol, data_dir, tmp_path / "hf.json")
        converted = _score(["--checkpoint", ckpt], task, protocol, data_dir, tmp_path / "ckpt.json")
        theirs = _score(["--hf", hf, "--backend", "transformers"], task, protocol, data_dir, tmp_path / "tf.json")
        key = "nll_sum" if "nll_sum" in ours else "ppl"
        assert ours["protocol"] == protocol and ours[key] > 0, ours
        for name in (key, "num_scored_tokens", "accuracy", "num_examples"):
            assert ours.get(name) == converted.get(name), (task, protocol, name, ours, converted)
        assert theirs[key] == pytest.approx(ours[key], rel=1e-5), (task, protocol)
        if "accuracy" in ours:
            assert theirs["accuracy"] == ours["accuracy"]
