"""LAMBADA zero-shot last-word prediction (OpenAI's detokenized test set, 5,153 passages).

Each passage's last whitespace word is the target. As Megatron-LM's `--strict-lambada`: context = the text
before the last word, stripped, BPE-encoded; target = BPE of " " + last word (often several tokens). Metrics:

- accuracy: strict last-word accuracy; an example counts only if greedy prediction is right at EVERY target
  token (teacher-forced on the earlier target tokens, which is what greedy decoding would see if right).
- accuracy_last_token: greedy prediction right at the final target token (given all text before it).
- ppl: target-word perplexity, exp(mean over examples of the word's summed NLL); ppl_per_token also reported.

Contexts longer than the model window are left-truncated so that context + target fits (W + 1 tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from megazoo.data.fileio import file_sha256
from megazoo.data.tokenizers.tokenizer import Tokenizer
from megazoo.eval.scoring import LogitsFn, batches, read_text_file, safe_exp, score_targets


@dataclass(frozen=True)
class LambadaExample:
    context: list[int]
    target: list[int]


@dataclass(frozen=True)
class LambadaData:
    path: str
    sha256: str
    examples: list[LambadaExample]


def read_lambada_texts(path: str | Path) -> list[str]:
    """The "text" of every line of a LAMBADA jsonl file; errors name the file and the (1-based) line."""
    texts = []
    for number, line in enumerate(read_text_file(path, "LAMBADA").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"LAMBADA file {path}, line {number}: not valid JSON ({error})") from error
        if not isinstance(record, dict) or "text" not in record:
            raise ValueError(f"LAMBADA file {path}, line {number}: no \"text\" field")
        text = record["text"]
        if not isinstance(text, str) or not text.split():
            raise ValueError(f"LAMBADA file {path}, line {number}: \"text\" is not a non-empty string")
        texts.append(text)
    return texts


def split_last_word(text: str) -> tuple[str, str]:
    """(context, last word): the context is everything before the last word's last occurrence, stripped."""
    last_word = text.split()[-1]
    return text[: text.rfind(last_word)].strip(), last_word


def make_examples(texts: list[str], tokenizer: Tokenizer) -> list[LambadaExample]:
    examples = []
    for text in texts:
        context, last_word = split_last_word(text)
        examples.append(LambadaExample(tokenizer.encode(context), tokenizer.encode(" " + last_word)))
    return examples


def load_lambada(path: str | Path, tokenizer: Tokenizer) -> LambadaData:
    return LambadaData(str(path), file_sha256(path), make_examples(read_lambada_texts(path), tokenizer))


def fit_to_context(example: LambadaExample, context: int) -> list[int]:
    """context + target, left-truncated to at most W + 1 tokens (the target always fits whole)."""
    if len(example.target) > context:
        raise ValueError(f"a LAMBADA target of {len(example.target)} tokens does not fit the context of {context}")
    return (example.context + example.target)[-(context + 1):]


def evaluate_lambada(logits_fn: LogitsFn, data: LambadaData, *, context: int, pad_id: int, batch_size: int = 8,
                     limit: int | None = None, progress: bool = False, model_name: str = "model") -> dict:
    """Score the examples (the first `limit` when given) and return the result record."""
    examples = data.examples if limit is None else data.examples[:limit]
    if not examples:
        raise ValueError(f"no LAMBADA examples to evaluate in {data.path}")
    correct = last_token_correct = scored_tokens = 0
    word_nll_sum = 0.0
    bar = tqdm(total=len(examples), desc="lambada", unit="example", disable=not progress)
    for group in batches(examples, batch_size):
        sequences = [fit_to_context(ex, context) for ex in group]
        width = max(len(seq) for seq in sequences) - 1  # right padding: causal positions never see it
        rows = torch.full((len(group), width + 1), pad_id, dtype=torch.long)
        for row, seq in enumerate(sequences):
            rows[row, : len(seq)] = torch.tensor(seq)
        nll, hit = score_targets(logits_fn(rows[:, :-1]), rows[:, 1:])
        for row, (ex, seq) in enumerate(zip(group, sequences)):
            # The target's n tokens are the last n targets of this row: positions len(seq)-1-n .. len(seq)-2.
            end = len(seq) - 1
            target_slice = slice(end - len(ex.target), end)
            correct += bool(hit[row, target_slice].all())
            last_token_correct += bool(hit[row, end - 1])
            word_nll_sum += nll[row, target_slice].sum().item()
            scored_tokens += len(ex.target)
        bar.update(len(group))
    bar.close()
    n = len(examples)
    return {
        "task": "lambada",
        "model": model_name,
        "data_file": data.path,
        "data_sha256": data.sha256,
        "context": context,
        "num_examples": n,
        "num_examples_in_file": len(data.examples),
        "num_correct": correct,
        "accuracy": correct / n,
        "num_correct_last_token": last_token_correct,
        "accuracy_last_token": last_token_correct / n,
        "num_target_tokens": scored_tokens,
        "nll_sum": word_nll_sum,
        "ppl": safe_exp(word_nll_sum / n),
        "ppl_per_token": safe_exp(word_nll_sum / scored_tokens),
    }


def summary_line(result: dict) -> str:
    return (f"lambada | {result['model']} | accuracy {result['accuracy']:.4f} ({result['num_correct']:,}/"
            f"{result['num_examples']:,}) | last-token accuracy {result['accuracy_last_token']:.4f} "
            f"| ppl {result['ppl']:.4f} | ppl per token {result['ppl_per_token']:.4f}")
