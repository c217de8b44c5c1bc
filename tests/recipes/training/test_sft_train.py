"""`[sft]` recipes: the Trainer reads SFT rows, counts response tokens only, and hands packed rows' segment ids to
the model through the pipeline engine: its step-0 loss equals the model's loss on the same rows computed here."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from recipe_helpers import tiny_recipe

from megazoo.data.sft.dataset import write_sft_dataset
from megazoo.data.sft.examples import SFTExamples
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer


def _dataset(tmp_path, seq_len: int = 32, n: int = 24) -> str:
    rng = np.random.default_rng(3)
    examples = SFTExamples(rows=n)
    for _ in range(n):
        length = int(rng.integers(4, seq_len // 2))
        prompt = int(rng.integers(1, length - 1))
        examples.ids.append(rng.integers(1, 300, length).tolist())
        examples.masks.append([0] * prompt + [1] * (length - prompt))
    prefix = str(tmp_path / "sft")
    write_sft_dataset(examples, prefix, 300, template="chatml", seq_len=seq_len)
    return prefix


@pytest.mark.parametrize("packing, stage", [(True, 3), (False, 0)])
def test_trainer_loss_is_the_response_token_mean_of_its_rows(tmp_path, packing, stage):
    recipe = tiny_recipe(sft={"path": _dataset(tmp_path), "packing": packing}, zero={"stage": stage},
                         train={"steps": 2, "micro_batch": 2, "eval_every": 0}, run={"dir": str(tmp_path / "run")})
    trainer = Trainer(resolve(recipe), Topology.solo())
    rows = trainer.data.train
    assert rows.packing is packing and (max(map(len, rows.rows)) > 1) is packing
    (indices,) = trainer.sampler.indices_for_step(0)
    inputs, targets, segments = rows.batch(indices)
    model = trainer.chunks[0]
    with torch.no_grad(), trainer.zero.gathered() if stage == 3 else contextlib.nullcontext():
        expected = model.loss(model(inputs, segment_ids=segments if packing else None), targets)
        leaky = model.loss(model(inputs), targets)  # packed rows without their segments: examples see each other
    metrics = trainer.train_step(0)
    assert metrics["loss"] == pytest.approx(float(expected), rel=1e-12)
    if packing:
        assert abs(float(leaky) - float(expected)) > 1e-6  # so the check above needs the segments to arrive
    assert (targets == -100).any() and (targets != -100).any()


def test_sft_recipe_errors_name_the_field(tmp_path):
    prefix = _dataset(tmp_path, seq_len=32)
    with pytest.raises(RecipeError, match=r"sft.path = .* up to 32 tokens .* train.seq_len = 16; valid: "
                                          r"train.seq_len >= 32"):
        resolve(tiny_recipe(sft={"path": prefix}, train={"seq_len": 16}))
    with pytest.raises(RecipeError, match="no SFT dataset there"):
        resolve(tiny_recipe(sft={"path": str(tmp_path / "missing")}))
    with pytest.raises(RecipeError, match="sft.valid_path = 'x' is set but sft.path is empty"):
        resolve(tiny_recipe(sft={"valid_path": "x"}))
    with pytest.raises(RecipeError, match="tokenized with 300 ids but model.vocab_size = 200"):
        resolve(tiny_recipe(sft={"path": prefix}, model={"vocab_size": 200}))
    with pytest.raises(RecipeError, match=r"unknown recipe key\(s\) sft.pack; valid keys in \[sft\]: path, "
                                          "valid_path, packing"):
        tiny_recipe(sft={"pack": True})


@pytest.mark.parametrize("parallel, micro_batch, packing", [({"pp": 2}, 2, True), ({"dp": 2}, 1, True),
                                                             ({"tp": 2}, 2, True), ({"cp": 2}, 2, False)],
                         ids=["pp2", "dp2", "tp2", "cp2-padded"])
def test_sft_training_across_processes_equals_one_process(tmp_path, parallel, micro_batch, packing):
    """One SFT step (global batch 4) at pp=2 (the segment ids reach both stages' attention), tp=2 (each rank's
    heads attend inside the packed examples without a mask), dp=2 (each rank's
    micro-batches weighted by their share of the whole step's response tokens) or cp=2 (padded rows, -100 targets
    split with the sequence) give the single process's losses and parameters (fp64, 1e-10)."""
    from harness import run_distributed
    prefix = _dataset(tmp_path)

    def resolved(parallel: dict, micro_batch: int, run: str):
        return resolve(tiny_recipe(sft={"path": prefix, "packing": packing}, parallel=parallel,
                                   run={"dir": str(tmp_path / run)},
                                   train={"steps": 1, "micro_batch": micro_batch, "grad_accum": 2, "eval_every": 0}))

    def train(res, topo):
        trainer = Trainer(res, topo)
        result = trainer.fit()
        return {"losses": result.losses, "params": trainer.full_state_dict()}

    ref = train(resolved({}, 2, "solo"), Topology.solo())
    res = resolved(parallel, micro_batch, "many")
    par = res.recipe.parallel
    for got in run_distributed(lambda: train(res, Topology.build(par.dp, par.tp, par.pp, cp=par.cp)),
                               res.world_size):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-10, atol=0)
        for name, value in ref["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-10, msg=name)


def test_any_split_of_a_step_trains_on_its_mean_over_response_tokens(tmp_path):
    """micro_batch 4 x accum 1 == 1 x 4 (fp64, 1e-10): each step's loss is the mean over all its response
    tokens, however unevenly they fall into micro-batches (a mean of micro-batch means would differ)."""
    prefix = _dataset(tmp_path)
    results = []
    for micro, accum in ((4, 1), (1, 4)):
        recipe = tiny_recipe(sft={"path": prefix}, run={"dir": str(tmp_path / f"run{micro}")},
                             train={"steps": 2, "micro_batch": micro, "grad_accum": accum, "eval_every": 0})
        trainer = Trainer(resolve(recipe), Topology.solo())
        results.append((trainer.fit().losses, trainer.full_state_dict()))
    rows = trainer.data.train
    counts = [int(rows.row_targets()[[i]].sum()) for i in trainer.sampler.global_indices_for_step(0)]
    assert len(set(counts)) > 1  # uneven rows: the split would matter without the weights
    for losses, params in results[1:]:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(results[0][0]), rtol=1e-10, atol=0)
        for name, value in results[0][1].items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-10, msg=name)


def test_closing_sample_answers_through_the_chat_template(tmp_path):
    """With [sft], the closing sample renders [sample] prompt as a user turn in the dataset's template and
    returns the generated answer alone: the same ids as decoding from that prompt by hand."""
    import json

    from megazoo.data.sft.chat_template import chat_prompt
    from megazoo.data.sft.preprocess import preprocess_sft
    from megazoo.data.tokenizers.loading import load_tokenizer
    from megazoo.recipes.training.sample import generate
    bpe = "/work/shared/data/gpt2_bpe"
    tok = load_tokenizer(bpe)
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"prompt": "Sort a list.", "response": "def sorted(xs):"}) + "\n")
    preprocess_sft([src], tok, tmp_path / "sft", seq_len=64, template="chatml")
    recipe = tiny_recipe(sft={"path": str(tmp_path / "sft")}, data={"tokenizer": bpe},
                         model={"vocab_size": 50257, "n_layer": 1}, sample={"prompt": "Reverse a list.", "tokens": 6},
                         train={"steps": 1, "micro_batch": 1, "seq_len": 64, "eval_every": 0},
                         run={"dir": str(tmp_path / "run")})
    trainer = Trainer(resolve(recipe), Topology.solo())
    prompt = chat_prompt(tok, "chatml", "Reverse a list.")
    assert tok.decode(prompt).endswith("Reverse a list.<|im_end|>\n<|im_start|>assistant\n")
    expected = generate(trainer.model, prompt, 6, temperature=0.8, top_k=40, seed=recipe.train.seed)[len(prompt):]
    assert trainer.sample() == tok.decode(expected)
