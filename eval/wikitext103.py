"""WikiText-103 zero-shot perplexity with overlapping windows (Megatron-LM's `--overlapping-eval`).

1. Read the word-level test file, count its words Megatron's way, N_orig = len(text.strip().split(" ")), then
   detokenize it (eval/detokenizer.py) and GPT-2-BPE it as one string, no eod: N_bpe tokens.
2. Slide a window of W + 1 tokens (W = model context) by stride s: window k holds tokens [k*s, k*s + W],
   inputs its first W, targets its last W, padded past the end of the file. Window 0 scores all its targets;
   every later window scores only its last s, which it predicts with at least W - s tokens of context. So
   every token but the first is scored exactly once (`window_schedule`).
3. ppl = exp(NLL / (N_bpe - 1)); adjusted ppl = exp(NLL / (N_orig - 1)), the per-word perplexity comparable
   with word-level models. On the real test file N_orig = 245,566 and N_bpe = 270,330 (ratio 1.100845).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from megazoo.data.fileio import file_sha256
from megazoo.data.tokenizers.tokenizer import Tokenizer
from megazoo.eval.detokenizer import wikitext_detokenize
from megazoo.eval.scoring import LogitsFn, batches, read_text_file, safe_exp, score_targets


@dataclass(frozen=True)
class Window:
    """Window `index`: inputs tokens[start : start + W], targets tokens[start + 1 : start + W + 1].

    It scores target positions [first_scored, end_scored) of the window; position j predicts token start + j + 1.
    """

    index: int
    start: int
    first_scored: int
    end_scored: int

    @property
    def num_scored(self) -> int:
        return self.end_scored - self.first_scored


def window_schedule(num_tokens: int, context: int, stride: int) -> list[Window]:
    """The overlapping windows over `num_tokens` tokens: every token except the first is scored exactly once."""
    if context < 1 or not 1 <= stride <= context:
        raise ValueError(f"stride {stride} must be between 1 and the context length {context}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score one, got {num_tokens}")
    targets = num_tokens - 1
    # Window 0 covers targets 1..W; each later one adds s: 1 + ceil((targets - W) / s) windows in all.
    count = 1 + max(0, math.ceil((targets - context) / stride))
    schedule = []
    for k in range(count):
        start = k * stride
        first = 0 if k == 0 else context - stride
        end = min(context, targets - start)  # past the last real token the window is padding
        schedule.append(Window(k, start, first, end))
    return schedule


@dataclass(frozen=True)
class WikiTextData:
    path: str
    sha256: str
    tokens: list[int]  # GPT-2 BPE of the detokenized file
    num_original_tokens: int  # Megatron's word count of the raw file

    @property
    def num_bpe_tokens(self) -> int:
        return len(self.tokens)

    @property
    def token_ratio(self) -> float:
        return (self.num_bpe_tokens - 1) / (self.num_original_tokens - 1)


def load_wikitext(path: str | Path, tokenizer: Tokenizer) -> WikiTextData:
    """Read, count, detokenize and tokenize a WikiText `.tokens` file."""
    text = read_text_file(path, "WikiText")
    num_original = len(text.strip().split(" "))
    tokens = tokenizer.encode(wikitext_detokenize(text))
    if len(tokens) < 2 or num_original < 2:
        raise ValueError(f"WikiText file {path} has too little text to evaluate ({len(tokens)} tokens)")
    return WikiTextData(str(path), file_sha256(path), tokens, num_original)


def evaluate_wikitext(logits_fn: LogitsFn, data: WikiTextData, *, context: int, stride: int = 32,
                      pad_id: int, batch_size: int = 4, limit: int | None = None, progress: bool = False,
                      model_name: str = "model") -> dict:
    """Score the windows (the first `limit` of them when given) and return the result record.

    With `limit`, ppl and adjusted ppl are over the scored tokens only (adjusted through the whole file's
    token ratio); without it, num_scored_tokens = N_bpe - 1 and both equal Megatron-LM's numbers.
    """
    schedule = window_schedule(data.num_bpe_tokens, context, stride)
    if limit is not None:
        schedule = schedule[:limit]
    tokens = torch.tensor(data.tokens, dtype=torch.long)
    total_nll, total_scored = 0.0, 0
    bar = tqdm(total=len(schedule), desc="wikitext103", unit="window", disable=not progress)
    for group in batches(schedule, batch_size):
        # (b, W + 1) windows padded with pad_id; the mask keeps only each window's scored targets.
        rows = torch.full((len(group), context + 1), pad_id, dtype=torch.long)
        mask = torch.zeros(len(group), context, dtype=torch.bool)
        for row, w in enumerate(group):
            piece = tokens[w.start: w.start + context + 1]
            rows[row, : len(piece)] = piece
            mask[row, w.first_scored: w.end_scored] = True
        # Later windows score only their last s positions: skip the softmax over the rest (a (b, W, V) tensor).
        lo = min(w.first_scored for w in group)
        nll, _ = score_targets(logits_fn(rows[:, :-1])[:, lo:], rows[:, 1 + lo:])
        total_nll += nll[mask[:, lo:]].sum().item()
        total_scored += int(mask.sum())
        bar.update(len(group))
    bar.close()
    avg_nll = total_nll / total_scored
    return {
        "task": "wikitext103",
        "model": model_name,
        "data_file": data.path,
        "data_sha256": data.sha256,
        "context": context,
        "stride": stride,
        "num_original_tokens": data.num_original_tokens,
        "num_bpe_tokens": data.num_bpe_tokens,
        "token_ratio": data.token_ratio,
        "num_windows": len(schedule),
        "num_scored_tokens": total_scored,
        "complete": total_scored == data.num_bpe_tokens - 1,
        "nll_sum": total_nll,
        "avg_nll": avg_nll,
        "ppl": safe_exp(avg_nll),
        "adjusted_ppl": safe_exp(avg_nll * data.token_ratio),
    }


def summary_line(result: dict) -> str:
    return (f"wikitext103 | {result['model']} | ppl {result['ppl']:.4f} | adjusted ppl {result['adjusted_ppl']:.4f} "
            f"| avg nll {result['avg_nll']:.4f} | tokens scored {result['num_scored_tokens']:,} "
            f"of {result['num_bpe_tokens'] - 1:,} | original {result['num_original_tokens']:,} "
            f"| ratio {result['token_ratio']:.6f} | W {result['context']} s {result['stride']}")
