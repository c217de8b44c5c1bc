"""One HF GPT-2, three ways: transformers directly, our GPT at tp=1 and at tp=2, give the same eval numbers.

Real data (../shared/data), a tiny random model, and a prefix of each task (--limit) to stay fast.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from transformers import GPT2Config, GPT2LMHeadModel

from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megazoo.eval.lambada import evaluate_lambada, load_lambada
from megazoo.eval.scoring import gpt_logits_fn, hf_logits_fn
from megazoo.eval.wikitext103 import evaluate_wikitext, load_wikitext
from megazoo.models.hf.gpt2 import import_hf_dir
from megazoo.parallel.topology import Topology

WIKI_WINDOWS, LAMBADA_EXAMPLES = 24, 48
FLOAT_KEYS = ("nll_sum", "avg_nll", "ppl", "adjusted_ppl", "ppl_per_token", "accuracy", "accuracy_last_token")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, initializer_range=0.1)
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    GPT2LMHeadModel(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def datasets(data_dir):
    tokenizer = GPT2BPETokenizer.from_dir(data_dir / "gpt2_bpe")
    return (load_wikitext(data_dir / "wikitext103" / "wiki.test.tokens", tokenizer),
            load_lambada(data_dir / "lambada" / "lambada_test.jsonl", tokenizer))


def run_both(logits_fn, datasets, name):
    wiki, lambada = datasets
    return (evaluate_wikitext(logits_fn, wiki, context=128, stride=32, pad_id=50256, batch_size=8,
                              limit=WIKI_WINDOWS, model_name=name),
            evaluate_lambada(logits_fn, lambada, context=128, pad_id=50256, batch_size=8,
                             limit=LAMBADA_EXAMPLES, model_name=name))


def _ours(hf_dir, datasets, tp):
    topology = Topology.solo() if tp == 1 else Topology.build(dp=1, tp=tp)
    return run_both(gpt_logits_fn(import_hf_dir(hf_dir, topology)), datasets, "tiny")


@pytest.fixture(scope="module")
def reference(hf_dir, datasets):
    return run_both(hf_logits_fn(GPT2LMHeadModel.from_pretrained(str(hf_dir))), datasets, "tiny")


def assert_same_results(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if key in FLOAT_KEYS:
            assert got[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert got[key] == value, key


def test_reference_is_sensible(reference):
    wiki, lambada = reference
    assert wiki["num_windows"] == WIKI_WINDOWS
    assert wiki["num_scored_tokens"] == 128 + (WIKI_WINDOWS - 1) * 32
    assert 1.0 < wiki["ppl"] < float("inf") and wiki["adjusted_ppl"] > wiki["ppl"]
    assert lambada["num_examples"] == LAMBADA_EXAMPLES and lambada["num_examples_in_file"] == 5_153
    assert lambada["num_target_tokens"] >= LAMBADA_EXAMPLES


def test_tp1_matches_transformers(hf_dir, datasets, reference):
    for got, expected in zip(_ours(hf_dir, datasets, 1), reference):
        assert_same_results(got, expected)


def test_tp2_matches_transformers(hf_dir, datasets, reference):
    for rank_results in run_distributed(_ours, 2, hf_dir, datasets, 2):
        for got, expected in zip(rank_results, reference):
            assert_same_results(got, expected)
