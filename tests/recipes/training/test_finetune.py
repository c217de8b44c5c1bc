"""The fine-tuning path end to end: a Hugging Face GPT-2 -> megazoo checkpoint -> fine-tuned at another layout
(dp=2 under ZeRO-3) on a user corpus -> saved -> exported from ZeRO-3 to Hugging Face with the same logits ->
evaluated."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import torch
from harness import run_distributed
from recipe_helpers import TINY
from hf_helpers import tiny_hf_model
from transformers import GPT2LMHeadModel

from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megazoo.data.indexed.preprocess import preprocess
from megazoo.eval.cli import main as eval_main
from megazoo.models.hf.convert_cli import load_consolidated, register, save_consolidated
from megazoo.models.hf.gpt2 import config_from_hf, gpt_from_full_state, hf_to_megazoo_state
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

FINETUNE_RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "finetune.toml"


def _finetune(ckpt: str, corpus: str, tokenizer: str, run_dir: str, hf_state: dict):
    """recipes/finetune.toml, shrunk to the tiny HF model and this test's corpus, at dp=2 under ZeRO-3."""
    table = tomllib.loads(FINETUNE_RECIPE.read_text())
    overrides = {
        "model": {"preset": "gpt2-tiny", "n_layer": 2, "d_model": 64, "n_head": 4, "n_positions": 128,
                  "vocab_size": 50257, "dropout": 0.0, "attn_dropout": 0.0},
        "parallel": {"dp": 2}, "zero": {"stage": 3},
        "train": {**TINY["train"], "steps": 4, "micro_batch": 2, "seq_len": 64, "lr": 1e-3, "precision": "fp32",
                  "eval_every": 0},
        "data": {"source": "indexed", "paths": [corpus], "tokenizer": tokenizer},
        "checkpoint": {"load": ckpt, "load_optimizer": False, "every": 4}, "run": {"dir": run_dir},
        "logging": TINY["logging"], "kernels": TINY["kernels"], "sample": {"tokens": 0}}
    for section, values in overrides.items():
        table.setdefault(section, {}).update(values)
    res = resolve(from_dict(Recipe, table))
    trainer = Trainer(res, Topology.build(2, 1))
    start = trainer.load_checkpoint(res.recipe.checkpoint.load + "/step_00000000", load_optimizer=False)
    loaded = trainer.full_state_dict()
    same_start = all(torch.equal(loaded[k], hf_state[k]) for k in hf_state)
    result = trainer.fit(start_step=start)
    return start, same_start, result.losses, trainer.full_state_dict()


def test_hf_to_finetune_at_zero3_to_hf_and_eval(tmp_path, data_dir):
    hf = tiny_hf_model()
    cfg = config_from_hf(hf.config, name="tiny-hf")
    state = hf_to_megazoo_state(hf.state_dict(), cfg)
    ckpt = save_consolidated(state, cfg, tmp_path / "from-hf")

    lines = (data_dir / "wikitext103" / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines()[:400]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(lines[i:i + 20])}) + "\n" for i in range(0, 400, 20)))
    tokenizer = GPT2BPETokenizer.from_dir(data_dir / "gpt2_bpe")
    preprocess([corpus], tokenizer, str(tmp_path / "corpus"), progress=False)

    results = run_distributed(_finetune, 2, str(ckpt), str(tmp_path / "corpus"), str(data_dir / "gpt2_bpe"),
                              str(tmp_path / "run"), state)
    start, same_start, losses, tuned = results[0]
    assert start == 0 and same_start  # resharded into dp=2 ZeRO-3, the HF weights exactly
    assert losses[-1] < losses[0]
    assert not torch.equal(tuned["h.0.mlp.c_fc.weight"], state["h.0.mlp.c_fc.weight"])

    # Export the ZeRO-3 checkpoint to Hugging Face: transformers loads it and computes our logits.
    import argparse
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", "megazoo-to-hf", str(tmp_path / "run" / "checkpoints"),
                              "--out", str(tmp_path / "hf-out")])
    assert args.func(args) == 0
    exported = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf-out")).eval()
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    cfg_back, full = load_consolidated(tmp_path / "run" / "checkpoints")
    ours = gpt_from_full_state(cfg_back, full, Topology.solo()).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, ours(ids)[..., :50257], rtol=1e-5, atol=1e-5)
    assert all(full[k].numel() and torch.equal(full[k], tuned[k]) for k in tuned)  # never empty tensors

    out = tmp_path / "lambada.json"
    code = eval_main(["lambada", "--checkpoint", str(tmp_path / "run" / "checkpoints"), "--data",
                      str(data_dir / "lambada" / "lambada_test.jsonl"), "--tokenizer", str(data_dir / "gpt2_bpe"),
                      "--limit", "8", "--json", str(out)])
    assert code == 0 and json.loads(out.read_text())["num_examples"] == 8
