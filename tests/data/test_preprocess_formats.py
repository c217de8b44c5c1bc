"""Issue 15 item 5: `megazoo preprocess` creates its output folder, writes files with the user's umask, reads
jsonl, text, parquet and Hugging Face `datasets` folders (the same documents give the same bytes), and Megatron-LM
MMIDIDX datasets (written here in that exact layout) are read directly and sample like megazoo's own."""

from __future__ import annotations

import json
import os
import stat
import struct

import numpy as np
import pytest
import torch
from recipe_helpers import tiny_resolved

from megazoo.data.gpt_dataset import GPTDataset
from megazoo.data.indexed.dataset import IndexedDataset
from megazoo.data.indexed.formats import check_indexed, open_indexed
from megazoo.data.indexed.megatron import MegatronIndexedDataset
from megazoo.data.indexed.preprocess import PreprocessError, main, preprocess
from megazoo.data.tokenizers.tokenizer import BPETokenizer
from megazoo.recipes.config import RecipeError

DOCS = [f"Paragraph {i}: a river runs {i % 7} miles past the old mill, where the miller's dog sleeps."
        for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    BPETokenizer.train(DOCS, 320).save(path)
    return path


def test_output_folder_is_created_and_files_follow_the_umask(tmp_path, tokenizer_file):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    old = os.umask(0o022)
    try:
        assert main(["--input", str(corpus), "--tokenizer", str(tokenizer_file), "--output-prefix",
                     str(tmp_path / "new" / "deeper" / "wiki"), "--workers", "1"]) == 0
    finally:
        os.umask(old)
    for suffix in (".bin", ".idx"):
        assert stat.S_IMODE((tmp_path / "new" / "deeper" / f"wiki{suffix}").stat().st_mode) == 0o644
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    assert main(["--input", str(bad), "--tokenizer", str(tokenizer_file), "--output-prefix",
                 str(tmp_path / "never" / "made" / "x"), "--workers", "1"]) == 2
    assert not (tmp_path / "never").exists()  # a failed run leaves no folder behind


def _bytes(prefix) -> bytes:
    return open(str(prefix) + ".bin", "rb").read()


def test_parquet_and_datasets_give_the_same_dataset_as_jsonl(tmp_path, tokenizer_file):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = BPETokenizer.load(tokenizer_file)
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    preprocess([jsonl], tok, tmp_path / "from_jsonl", text_key="body", progress=False)
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "body": DOCS}), tmp_path / "c.parquet", row_group_size=7)
    preprocess([tmp_path / "c.parquet"], tok, tmp_path / "from_parquet", text_key="body", workers=2, progress=False)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": DOCS}),
                          "test": datasets.Dataset.from_dict({"body": DOCS[:3]})}).save_to_disk(tmp_path / "hf")
    preprocess([tmp_path / "hf"], tok, tmp_path / "from_hf", text_key="body", progress=False)
    assert _bytes(tmp_path / "from_jsonl") == _bytes(tmp_path / "from_parquet") == _bytes(tmp_path / "from_hf")
    assert len(IndexedDataset(tmp_path / "from_hf")) == len(DOCS)
    preprocess([tmp_path / "hf"], tok, tmp_path / "test_split", text_key="body", split="test", progress=False)
    assert len(IndexedDataset(tmp_path / "test_split")) == 3
    with pytest.raises(PreprocessError, match=r"has no 'text' column \(columns: 'id', 'body'\)"):
        preprocess([tmp_path / "c.parquet"], tok, tmp_path / "x", progress=False)
    with pytest.raises(PreprocessError, match=r"no split 'valid'; splits: train, test"):
        preprocess([tmp_path / "hf"], tok, tmp_path / "x", text_key="body", split="valid", progress=False)
    pq.write_table(pa.table({"body": ["fine", None]}), tmp_path / "null.parquet")
    with pytest.raises(PreprocessError, match=r"null.parquet row:2: field 'body' is NoneType"):
        preprocess([tmp_path / "null.parquet"], tok, tmp_path / "x", text_key="body", progress=False)


def write_megatron(prefix, docs: list[np.ndarray], dtype=np.uint16, code: int = 8) -> None:
    """PREFIX.bin/.idx in Megatron-LM's MMIDIDX layout: magic, version 1, dtype code, sequence and document
    counts, int32 lengths, int64 byte pointers, int64 document indices (one sequence per document)."""
    lengths = np.array([len(d) for d in docs], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)])
    with open(str(prefix) + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1))
        f.write(lengths.tobytes() + pointers.astype("<i8").tobytes() + np.arange(len(docs) + 1, dtype="<i8").tobytes())


@pytest.mark.parametrize("dtype, code", [(np.uint16, 8), (np.int32, 4)])
def test_megatron_datasets_are_read_directly(tmp_path, tokenizer_file, dtype, code):
    tok = BPETokenizer.load(tokenizer_file)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    preprocess([corpus], tok, tmp_path / "ours", progress=False)
    ours = IndexedDataset(tmp_path / "ours")
    write_megatron(tmp_path / "meg", [np.asarray(ours.doc(i)) for i in range(len(ours))], dtype, code)
    theirs = open_indexed(tmp_path / "meg")
    assert isinstance(theirs, MegatronIndexedDataset) and len(theirs) == len(ours)
    assert theirs.num_tokens == ours.num_tokens
    assert all(np.array_equal(theirs.doc(i), ours.doc(i)) for i in range(len(ours)))
    assert check_indexed(tmp_path / "meg", tok.vocab_size).verify_data() == ours.verify_data()
    # the same tokens give the same training samples as megazoo's own format
    a = GPTDataset(ours, 16, 3, num_samples=40, cache_dir=tmp_path / "cache")
    b = GPTDataset(theirs, 16, 3, num_samples=40, cache_dir=tmp_path / "cache")
    assert torch.equal(a.stack(range(40)), b.stack(range(40)))
    # and a recipe names it like any other prefix: vocabulary from the tokenizer, token ids checked
    res = tiny_resolved(data={"source": "indexed", "paths": [str(tmp_path / "meg")], "tokenizer": str(tokenizer_file)},
                        model={"vocab_size": None}, run={"dir": str(tmp_path / "run")})
    assert res.model.vocab_size == tok.vocab_size
    with pytest.raises(RecipeError, match="outside the vocabulary"):
        tiny_resolved(data={"source": "indexed", "paths": [str(tmp_path / "meg")]}, model={"vocab_size": 100},
                      run={"dir": str(tmp_path / "run")})


def test_damaged_megatron_files_are_reported(tmp_path):
    write_megatron(tmp_path / "m", [np.arange(10), np.arange(5)])
    with open(tmp_path / "m.bin", "r+b") as f:
        f.truncate(20)
    with pytest.raises(ValueError, match=r"m.bin is truncated: 20 bytes, but m.idx describes 30"):
        open_indexed(tmp_path / "m")
    write_megatron(tmp_path / "f", [np.arange(4)], np.float32, 7)
    with pytest.raises(ValueError, match=r"token dtype code 7 is not an integer type"):
        open_indexed(tmp_path / "f")
    write_megatron(tmp_path / "n", [np.array([3, -2, 5])], np.int32, 4)
    with pytest.raises(ValueError, match=r"negative token id -2"):
        check_indexed(tmp_path / "n", 10)
