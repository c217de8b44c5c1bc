"""Small stand-ins for a shipped recipe's user files (corpus, tokenizer, checkpoint to start from), so a recipe is
checked at its real size without the user's data, wherever the checkout lives."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from megazoo.data.indexed.dataset import IndexedDatasetWriter
from megazoo.recipes.config import load_recipe
from megazoo.recipes.resolve import model_config


def stand_in_gpt2_bpe(folder: Path) -> Path:
    """A GPT-2 BPE folder with GPT-2's vocabulary size (50,257 ids, `<|endoftext|>` = 50256) and one merge: the
    recipe checks read only the tokenizer's size, so the shipped recipes resolve without the real files, from a
    checkout anywhere (the real files' own tests: tests/eval/test_eval_data.py, test_data_catalog.py)."""
    from tokenizers import pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ab"]  # every byte, so any text encodes
    symbols += [f"<stand-in {i}>" for i in range(50256 - len(symbols))] + ["<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(symbols)}))
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    return folder


def stand_in_overrides(path: Path, tmp_path: Path) -> list[str]:
    """Overrides pointing a recipe's user files (corpus, tokenizer, checkpoint to start from) at small stand-ins,
    so the recipe itself is checked at its real size without the user's data, wherever the checkout lives."""
    table = load_recipe(path)
    overrides = []
    if table.data.source == "indexed":  # a small valid corpus: the resolver checks magic, sizes and checksums
        with IndexedDatasetWriter(tmp_path / "corpus", 50257) as writer:
            for doc in range(4):
                writer.add_document(np.arange(doc, doc + 100) % 50257)
        overrides += [f'data.paths=["{tmp_path / "corpus"}"]', "data.valid_paths=[]"]
    if table.data.tokenizer and not Path(table.data.tokenizer).exists():  # "gpt2-bpe", a data catalog name
        overrides.append(f"data.tokenizer={stand_in_gpt2_bpe(tmp_path / 'gpt2_bpe')}")
    if table.sft.path:  # a few SFT rows (tokens + loss mask): `megazoo data sft-demo` builds the real ones
        from megazoo.data.sft.dataset import write_sft_dataset
        from megazoo.data.sft.examples import SFTExamples

        rows = SFTExamples(ids=[list(range(1, 20)), list(range(5, 15))], masks=[[0] * 12 + [1] * 7, [0] * 6 + [1] * 4],
                           rows=2)
        write_sft_dataset(rows, tmp_path / "sft", 300, template="chatml", seq_len=table.train.seq_len)
        overrides.append(f"sft.path={tmp_path / 'sft'}")
    if table.model.from_hf:  # a stand-in HF folder: the resolver reads only its config.json
        from megazoo.models.hf.families import family_of_config

        cfg = model_config(load_recipe(path, [*overrides, "model.from_hf="]))
        family_of_config(cfg).config_to_hf(cfg).save_pretrained(str(tmp_path / "hf"))
        overrides.append(f"model.from_hf={tmp_path / 'hf'}")
    if table.checkpoint.load:  # a stand-in step directory: the resolver reads only its common.json's model
        step = tmp_path / "checkpoint" / "step_00000000"
        step.mkdir(parents=True)
        cfg = model_config(load_recipe(path, [*overrides, "model.from_checkpoint=false"]))
        (step / "common.json").write_text(json.dumps({"step": 0, "model": dataclasses.asdict(cfg)}))
        overrides.append(f"checkpoint.load={step.parent}")
    return overrides
