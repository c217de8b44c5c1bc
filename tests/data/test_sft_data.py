"""`megazoo preprocess --format sft`: chat templates, loss masks, the bad-row report, the files it writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megazoo.data.sft.chat_template import (ChatTemplateError, chat_encoder, check_messages, encode_conversation,
                                        resolve_template)
from megazoo.data.indexed.preprocess import main as preprocess_main
from megazoo.data.sft.dataset import MASK_SUFFIX, SFTDataset, sft_paths
from megazoo.data.sft.packing import SFTRows
from megazoo.data.sft.preprocess import BadRowsError, preprocess_sft
from megazoo.data.tokenizers.loading import load_tokenizer

GPT2_BPE = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2_bpe"


@pytest.fixture(scope="module")
def gpt2(shared_data_dir=None):
    return load_tokenizer(GPT2_BPE if GPT2_BPE.is_dir() else Path("/work/shared/data/gpt2_bpe"))


GOOD = [
    {"prompt": "Add two numbers.", "response": "def add(a, b):"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                  {"role": "assistant", "content": "Bye."}]},
]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_builtin_templates_train_exactly_the_replies(gpt2, template):
    _, render = resolve_template(gpt2, template)
    encode = chat_encoder(gpt2)
    messages = check_messages(GOOD[1]["messages"])
    ids, mask = encode_conversation(messages, render, encode)
    trained = [i for i, m in zip(ids, mask) if m]
    replies = [render(messages[:k + 1], False)[len(render(messages[:k], True)):] for k in (2, 4)]
    assert replies[0].startswith("Hello.") and replies[1].startswith("Bye.")
    if template == "chatml":  # every boundary is a token boundary: exactly the replies
        assert gpt2.decode(trained) == "".join(replies)
    else:  # GPT-2's BPE lacks Llama 3's special tokens, so tokens merge across its markers ("\n\n", "|><|"): a
        # merged token goes with the text after the boundary (TRL's rule), never the prompt's words
        text = gpt2.decode(trained)
        assert "Hello." in text and "Bye." in text and "brief" not in text and "Hi" not in text
    assert gpt2.decode(ids) == render(messages, False)


def test_prompt_is_the_trained_context(gpt2):
    from megazoo.data.sft.chat_template import encode_prompt
    _, render = resolve_template(gpt2, "chatml")
    encode = chat_encoder(gpt2)
    ids, mask = encode_conversation(check_messages(GOOD[1]["messages"][:3]), render, encode)
    prompt = encode_prompt(GOOD[1]["messages"][:2], render, encode)
    assert ids[:len(prompt)] == prompt and mask.index(1) == len(prompt)  # the reply starts where the prompt ends


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ([{"role": "user", "content": "x"}], "no assistant message"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\].role 'bot' is unknown; valid: system, user, assistant"),
    ([{"role": "user"}], r"messages\[0\] has no 'content' field"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content is int, expected a string"),
    ([{"role": "assistant", "content": "x"}], "needs a message before it"),
])
def test_bad_messages_are_named(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        check_messages(messages)


def test_unknown_template_and_missing_own_template_name_the_valid_ones(gpt2):
    with pytest.raises(ChatTemplateError, match="valid: auto, tokenizer, chatml, llama3"):
        resolve_template(gpt2, "vicuna")
    with pytest.raises(ChatTemplateError, match="no chat template of its own.*chatml, llama3"):
        resolve_template(gpt2, "auto")


def test_bad_rows_are_all_reported_with_line_and_reason(gpt2, tmp_path):
    rows = [GOOD[0], "{not json", {"prompt": "only a prompt"}, {"text": "pretraining row"},
            {"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]},
            "", {"prompt": "p", "response": "word " * 150}, {"prompt": 5, "response": "r"}, GOOD[1]]
    src = _write_jsonl(tmp_path / "broken.jsonl", rows)
    with pytest.raises(BadRowsError) as caught:
        preprocess_sft([src], gpt2, tmp_path / "out", seq_len=128, template="chatml")
    report = str(caught.value)
    assert "6 of 8 rows are bad:" in report  # the blank line 6 is not a row
    for line, reason in [(2, "not valid JSON"), (3, "missing field 'response'"),
                         (4, "has neither 'messages' nor 'prompt' + 'response'"),
                         (5, "messages[1].role 'robot' is unknown"), (7, "186 tokens, longer than the sequence length 128"),
                         (8, "'prompt' is int, expected a string")]:
        assert f"{src}:{line}: {reason}" in report, report
    assert not any(p.exists() for p in sft_paths(tmp_path / "out"))  # fail: nothing written

    manifest = preprocess_sft([src], gpt2, tmp_path / "out", seq_len=128, template="chatml", bad_rows="skip")
    assert manifest["examples"] == 2 and manifest["rows"] == 8
    assert [bad["where"] for bad in manifest["bad_rows"]] == [f"{src}:{n}" for n in (2, 3, 4, 5, 7, 8)]
    assert json.loads(Path(f"{tmp_path / 'out'}.sft.json").read_text())["bad_rows"] == manifest["bad_rows"]


def test_dataset_reads_back_and_packs(gpt2, tmp_path):
    src = _write_jsonl(tmp_path / "good.jsonl", GOOD * 3)
    preprocess_sft([src], gpt2, tmp_path / "sft", seq_len=128, template="chatml")
    ds = SFTDataset(tmp_path / "sft")
    assert len(ds) == 6 and ds.seq_len == 128 and ds.manifest["template"] == "chatml"
    _, render = resolve_template(gpt2, "chatml")
    ids, mask = ds.example(1)
    want_ids, want_mask = encode_conversation(check_messages(GOOD[1]["messages"]), render, chat_encoder(gpt2))
    assert ids.tolist() == want_ids and mask.tolist() == want_mask
    rows = SFTRows(ds, 128)
    assert len(rows) < len(ds) and rows.stats().tokens == int(ds.lengths.sum())


def test_replaced_mask_file_is_detected(gpt2, tmp_path):
    preprocess_sft([_write_jsonl(tmp_path / "a.jsonl", GOOD)], gpt2, tmp_path / "a", seq_len=128, template="chatml")
    preprocess_sft([_write_jsonl(tmp_path / "b.jsonl", GOOD[::-1] + GOOD)], gpt2, tmp_path / "b", seq_len=128,
                   template="chatml")
    for suffix in (".bin", ".idx"):
        (tmp_path / f"a{MASK_SUFFIX}{suffix}").write_bytes((tmp_path / f"b{MASK_SUFFIX}{suffix}").read_bytes())
    with pytest.raises(ValueError, match="loss mask's example lengths do not match"):
        SFTDataset(tmp_path / "a")


def test_parquet_and_datasets_folder_inputs(gpt2, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([GOOD[0], {"prompt": None, "response": "x"}]), tmp_path / "rows.parquet")
    with pytest.raises(BadRowsError, match=r"rows.parquet row 2: missing field 'prompt'"):
        preprocess_sft([tmp_path / "rows.parquet"], gpt2, tmp_path / "p", seq_len=128, template="chatml")
    datasets.Dataset.from_list([GOOD[1]] * 2).save_to_disk(str(tmp_path / "hf"))
    manifest = preprocess_sft([tmp_path / "hf"], gpt2, tmp_path / "h", seq_len=256, template="llama3")
    assert manifest["examples"] == 2 and manifest["template"] == "llama3"


def test_cli_fails_with_the_report_and_writes_nothing(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "broken.jsonl", [GOOD[0], {"prompt": "p"}])
    base = ["--format", "sft", "--input", str(src), "--tokenizer", "/work/shared/data/gpt2_bpe",
            "--output-prefix", str(tmp_path / "o"), "--chat-template", "chatml"]
    assert preprocess_main(base) == 2
    assert "needs --seq-len" in capsys.readouterr().err
    assert preprocess_main(base + ["--seq-len", "128"]) == 2
    err = capsys.readouterr().err
    assert f"{src}:2: missing field 'response'" in err and "--bad-rows skip" in err
    assert not any(p.exists() for p in sft_paths(tmp_path / "o"))
    assert preprocess_main(base + ["--seq-len", "128", "--bad-rows", "skip"]) == 0
    captured = capsys.readouterr()
    assert "1 of 2 rows are bad" in captured.err and "1 examples of 2 rows" in captured.out
    assert np.asarray(SFTDataset(tmp_path / "o").example(0)[1]).sum() > 0
    assert preprocess_main(["--input", str(src), "--tokenizer", "x", "--output-prefix", "y", "--seq-len", "8"]) == 2
    assert "--seq-len applies to --format sft only" in capsys.readouterr().err


def test_stdlib_rows_pair_docstrings_with_signatures():
    from megazoo.data.sft.stdlib_sft import function_rows, stdlib_sft_rows
    source = ('def area(w: float, h: float = 1.0, *, unit="m") -> float:\n    """Rectangle area."""\n'
              'def _hidden(x):\n    """Private."""\n'
              'class A:\n    async def fetch(self, *urls, **kw):\n        """Fetch every url."""\n'
              'def undocumented(): pass\n')
    assert list(function_rows(source)) == [
        {"prompt": "Rectangle area.", "response": "def area(w: float, h: float=1.0, *, unit='m') -> float:"},
        {"prompt": "Fetch every url.", "response": "async def fetch(self, *urls, **kw):"}]
    train, val = stdlib_sft_rows(max_bytes=1_000_000, val_fraction=0.3)
    assert len(train) > 100 and len(val) > 10
