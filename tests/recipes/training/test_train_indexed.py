"""Training on indexed datasets written by `megazoo preprocess`: real WikiText text, GPT-2 BPE, blending,
dp sharding, and early errors for missing files."""

from __future__ import annotations

import json

import pytest
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved
from parity_helpers import assert_same_training

from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megazoo.data.indexed.preprocess import preprocess
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, data_dir):
    """Two indexed datasets from real WikiText-103 validation text (never the test file) + a validation set."""
    root = tmp_path_factory.mktemp("indexed")
    lines = (data_dir / "wikitext103" / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines()
    docs = [" ".join(lines[i:i + 20]) for i in range(0, 1200, 20)]
    tokenizer = GPT2BPETokenizer.from_dir(data_dir / "gpt2_bpe")
    prefixes = {}
    for name, part in (("a", docs[:30]), ("b", docs[30:50]), ("valid", docs[50:])):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in part), encoding="utf-8")
        preprocess([path], tokenizer, str(root / name), workers=1, progress=False)
        prefixes[name] = str(root / name)
    return prefixes, str(data_dir / "gpt2_bpe")


def _indexed(corpus, tmp_path, **sections):
    prefixes, tokenizer = corpus
    data = {"source": "indexed", "paths": [prefixes["a"], prefixes["b"]], "weights": [0.7, 0.3],
            "valid_paths": [prefixes["valid"]], "tokenizer": tokenizer}
    model = {"vocab_size": None, "n_layer": 2}  # the preset's GPT-2 vocabulary
    return tiny_resolved(data=data, model=model, run={"dir": str(tmp_path)}, **sections)


def _fit(res, topo):
    trainer = Trainer(res, topo)
    result = trainer.fit()
    return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
            "params": trainer.full_state_dict(), "sample": result.sample}


def test_trains_on_blended_wikitext_and_learns(corpus, tmp_path):
    res = _indexed(corpus, tmp_path, train={"steps": 30, "seq_len": 64, "lr": 3e-3, "precision": "fp32"},
                   sample={"tokens": 5, "prompt": "The"})
    got = _fit(res, Topology.solo())
    assert got["losses"][-1] < got["losses"][0] - 2.0  # from ln(50257) = 10.8
    assert got["val"] is not None and got["val"] < got["losses"][0]
    assert got["sample"].startswith("The") and len(got["sample"]) > 3  # decoded with the GPT-2 BPE


def test_dp2_on_indexed_data_equals_one_process(corpus, tmp_path):
    """Each dp rank reads its own slice of every global batch: the same training as one process."""
    ref = _fit(_indexed(corpus, tmp_path / "solo", train={"micro_batch": 8}), Topology.solo())
    res = _indexed(corpus, tmp_path / "dp2", parallel={"dp": 2}, train={"micro_batch": 4})
    for got in run_distributed(lambda: _fit(res, Topology.build(2, 1)), 2):
        assert_same_training(got, ref)


def test_missing_dataset_fails_before_training(corpus, tmp_path):
    prefixes, _ = corpus
    recipe = tiny_recipe(data={"source": "indexed", "paths": [prefixes["a"], str(tmp_path / "nope")]})
    with pytest.raises(RecipeError, match=r"data.paths: .*nope.bin does not exist"):
        resolve(recipe)
    with pytest.raises(RecipeError, match="one weight per path"):
        resolve(tiny_recipe(data={"source": "indexed", "paths": [prefixes["a"]], "weights": [1.0, 2.0]}))
    with pytest.raises(RecipeError, match="needs data.paths"):
        resolve(tiny_recipe(data={"source": "indexed"}))
    with pytest.raises(RecipeError, match=r"data.paths\[0\] = 3 has the wrong type"):
        resolve(tiny_recipe(data={"source": "indexed", "paths": [3]}))


def test_no_validation_paths_means_no_validation(corpus, tmp_path):
    prefixes, _ = corpus
    res = tiny_resolved(data={"source": "indexed", "paths": [prefixes["a"]]}, model={"vocab_size": None},
                        train={"steps": 2}, run={"dir": str(tmp_path)})
    assert Trainer(res, Topology.solo()).fit().val_loss is None


def test_a_tiny_corpus_is_said_to_repeat_with_its_epoch_count(tmp_path, capsys):
    """A 3-token corpus trains by reading itself hundreds of times over: the run says so (rank 0, stderr)."""
    from megazoo.data.indexed.dataset import IndexedDatasetWriter
    from megazoo.recipes.training.data_setup import load_data, repeat_warning

    with IndexedDatasetWriter(tmp_path / "tiny", vocab_size=300) as writer:
        writer.add_document([5, 6, 7])
    res = tiny_resolved(data={"source": "indexed", "paths": [str(tmp_path / "tiny")]},
                        train={"steps": 10, "micro_batch": 2, "seq_len": 16}, run={"dir": str(tmp_path / "run")})
    data = load_data(res, Topology.solo())
    needed = 10 * res.global_batch * 16
    assert f"holds 3 tokens, but 10 steps x {res.global_batch} sequences x 16 tokens = {needed:,} tokens" in \
        capsys.readouterr().err
    assert f"about {needed / 3:,.1f} times over (epochs)" in repeat_warning(res, data.train)
    roomy = tiny_resolved(train={"steps": 1, "micro_batch": 1, "seq_len": 16}, run={"dir": str(tmp_path / "r2")})
    assert repeat_warning(roomy, load_data(roomy, Topology.solo()).train) is None  # within one pass: silent
