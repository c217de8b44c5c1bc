"""The per-token labels of our packed SFT rows equal TRL's on the same examples.

TRL 1.x's SFTTrainer prepares a dataset in `_prepare_dataset` (chat template, `assistant_only_loss` masks from
the template's `{% generation %}` blocks, or `completion_only_loss` from prompt vs prompt + completion) and
collates packed rows with DataCollatorForLanguageModeling(padding_free=True). Its labels are input-aligned (the
model shifts them); ours are next-token targets, so ours[j] == TRL's[j + 1] within a row. The tokenizer is GPT-2's
BPE from the shared data folder with ChatML's two markers added: nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megazoo.data.sft.dataset import SFTDataset
from megazoo.data.sft.packing import IGNORE_INDEX, SFTRows
from megazoo.data.sft.preprocess import preprocess_sft
from megazoo.data.tokenizers.tokenizer import HFTokenizer

GPT2_BPE = Path("/work/shared/data/gpt2_bpe")
CHATML_WITH_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What does len do?"}, {"role": "assistant", "content": "It counts items."}],
    [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "Sum a list"},
     {"role": "assistant", "content": "sum(xs)"}, {"role": "user", "content": "And the max?"},
     {"role": "assistant", "content": "max(xs)"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "user", "content": "Reverse a string s."}, {"role": "assistant", "content": "s[::-1]"}],
    [{"role": "user", "content": "Sort xs"}, {"role": "assistant", "content": " sorted(xs)  "}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import GPT2TokenizerFast
    tok = GPT2TokenizerFast.from_pretrained(str(GPT2_BPE))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_WITH_GENERATION
    return tok


def _trl_prepare(tok, rows: list[dict], **loss_options):
    """TRL's own dataset preparation (SFTTrainer._prepare_dataset), without building a model or a Trainer."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    args = SFTConfig(output_dir="unused", max_length=None, report_to=[], use_cpu=True, bf16=False, **loss_options)
    trainer = SFTTrainer.__new__(SFTTrainer)  # the preparation reads only these three attributes
    trainer._tokenizer, trainer.chat_template = tok, None
    trainer.completion_only_loss = loss_options.get("completion_only_loss", True)
    return trainer._prepare_dataset(Dataset.from_list(rows), tok, args, False, None, "train")


def _check_rows_match_trl(rows: SFTRows, prepared) -> int:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    inputs, targets, _ = rows.batch(list(range(len(rows))))
    checked = 0
    for r, row in enumerate(rows.rows):
        trl = collate([{"input_ids": prepared[i]["input_ids"], "labels": prepared[i]["labels"]} for i in row])
        n = trl["input_ids"].shape[1]
        assert inputs[r, :n].tolist() == trl["input_ids"][0].tolist()
        shifted = torch.cat([trl["labels"][0, 1:], torch.tensor([IGNORE_INDEX])])  # input-aligned -> next-token
        assert targets[r, :n].tolist() == shifted.tolist()
        assert (targets[r, n:] == IGNORE_INDEX).all()
        checked += int((shifted != IGNORE_INDEX).sum())
    return checked


def test_messages_labels_equal_trl_assistant_only_loss(hf_tokenizer, tmp_path):
    import json
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    preprocess_sft([src], HFTokenizer(hf_tokenizer), tmp_path / "chat", seq_len=64, template="auto")
    rows = SFTRows(SFTDataset(tmp_path / "chat"), 64)
    assert any(len(row) > 1 for row in rows.rows)  # packing happened
    prepared = _trl_prepare(hf_tokenizer, [{"messages": c} for c in CONVERSATIONS], assistant_only_loss=True)
    assert _check_rows_match_trl(rows, prepared) > 20


def test_prompt_response_labels_equal_trl_completion_only_loss(hf_tokenizer, tmp_path):
    import json
    pairs = [(c[-2]["content"], c[-1]["content"]) for c in CONVERSATIONS]
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    preprocess_sft([src], HFTokenizer(hf_tokenizer), tmp_path / "pairs", seq_len=48, template="tokenizer")
    rows = SFTRows(SFTDataset(tmp_path / "pairs"), 48)
    prepared = _trl_prepare(hf_tokenizer, [{"prompt": [{"role": "user", "content": p}],
                                            "completion": [{"role": "assistant", "content": r}]} for p, r in pairs],
                            completion_only_loss=True)
    assert _check_rows_match_trl(rows, prepared) > 10
