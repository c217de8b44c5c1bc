"""lm-eval's protocol (EleutherAI lm-evaluation-harness 0.4.x) for LAMBADA and WikiText, without lm-eval.

`megazoo eval lambada|wikitext103 --protocol lm-eval` gives the numbers of lm-eval's `lambada_openai` and
`wikitext` tasks; the lm-eval adapter (eval/harness_model.py) scores lm-eval's own requests with the same two
functions below (`encode_pair`, `score_pairs`), so both paths compute one thing.

LAMBADA (`lambada_openai`): context = the words of `text.split(" ")` but the last, joined by " "; target = " " +
the last. So a last word after a newline keeps the text since the last space (example 426 of the test set ends
"some kind of\\n\\nPower": the target is " of\\n\\nPower", where Megatron's `text.split()` takes " Power").
A pair is tokenised as lm-eval's causal models do: trailing spaces of the context move to the target, the whole
text is encoded and the target is what follows the context's own encoding. Metrics: acc (greedy right at every
target token), perplexity = exp(-mean target log-likelihood).

WikiText (`wikitext`, document level): the raw file is cut into pages at each top-level heading (" = Title = ",
as the EleutherAI/wikitext_document_level dataset does: 62 pages in the test set), each page is detokenized
(the same rules as eval/detokenizer.py) and scored on its own: tokens predicted from an EOS prefix in disjoint
windows of the model's full context (lm-eval's rolling windows with context_len 1). word_perplexity =
exp(-sum ll / sum words), words counted as `len(re.split(r"\\s+", page))` on the page before detokenization;
byte_perplexity likewise over UTF-8 bytes; bits_per_byte = -sum ll / sum bytes / ln 2.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from megazoo.data.fileio import file_sha256
from megazoo.eval.detokenizer import wikitext_detokenize
from megazoo.eval.lambada import read_lambada_texts
from megazoo.eval.scoring import LogitsFn, read_text_file, safe_exp

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)


def encode_pair(encode, context: str, continuation: str, prefix_id: int) -> Pair:
    """lm-eval's TemplateLM.loglikelihood tokenisation of one (context, continuation) request."""
    if context == "":
        cont = encode(continuation)
        return ([prefix_id], cont) if prefix_id != cont[0] else (cont[:1], cont[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def score_pairs(logits_fn: LogitsFn, pairs: Sequence[Pair], *, max_length: int, pad_id: int, batch_size: int = 8,
                progress: bool = False, desc: str = "loglikelihood") -> list[tuple[float, bool, bool]]:
    """(log-likelihood of the continuation, greedy at every continuation token, greedy at its last token) per
    pair. The input is (context + continuation)[-(max_length + 1):][:-1], as lm-eval's causal models feed it;
    rows are right-padded (causal positions never see the padding)."""
    results: list[tuple[float, bool, bool]] = [(0.0, False, False)] * len(pairs)
    # Longest first, as lm-eval sorts: similar lengths share a batch, so little padding is computed.
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    bar = tqdm(total=len(pairs), desc=desc, unit="request", disable=not progress)
    for start in range(0, len(order), batch_size):
        group = order[start:start + batch_size]
        inputs = []
        for i in group:
            context, cont = pairs[i]
            if not context or not cont or len(cont) > max_length:
                raise ValueError(f"request {i}: context of {len(context)} and continuation of {len(cont)} tokens "
                                 f"cannot be scored with a context of {max_length}")
            inputs.append((context + cont)[-(max_length + 1):][:-1])
        width = max(len(ids) for ids in inputs)
        rows = torch.full((len(group), width), pad_id, dtype=torch.long)
        for row, ids in enumerate(inputs):
            rows[row, :len(ids)] = torch.tensor(ids)
        logprobs = F.log_softmax(logits_fn(rows).float(), dim=-1).cpu()
        for row, i in enumerate(group):
            cont, end = pairs[i][1], len(inputs[row])
            piece = logprobs[row, end - len(cont):end]  # (n, V): the predictions of the continuation
            target = torch.tensor(cont)
            greedy = piece.argmax(dim=-1) == target
            ll = piece.gather(-1, target[:, None]).sum()
            results[i] = (float(ll), bool(greedy.all()), bool(greedy[-1]))
        bar.update(len(group))
    bar.close()
    return results


def lambada_requests(texts: Sequence[str]) -> list[tuple[str, str]]:
    """lambada_openai's (context, continuation) of every passage."""
    return [(" ".join(text.split(" ")[:-1]), " " + text.split(" ")[-1]) for text in texts]


def evaluate_lambada(logits_fn: LogitsFn, path: str, tokenizer, *, context: int, pad_id: int, batch_size: int = 8,
                     limit: int | None = None, progress: bool = False, model_name: str = "model") -> dict:
    texts = read_lambada_texts(path)
    chosen = texts if limit is None else texts[:limit]
    pairs = [encode_pair(tokenizer.encode, c, t, tokenizer.eod_id) for c, t in lambada_requests(chosen)]
    scored = score_pairs(logits_fn, pairs, max_length=context, pad_id=pad_id, batch_size=batch_size,
                         progress=progress, desc="lambada (lm-eval)")
    n = len(scored)
    nll = -sum(ll for ll, _, _ in scored)
    tokens = sum(len(cont) for _, cont in pairs)
    correct = sum(hit for _, hit, _ in scored)
    return {"task": "lambada", "protocol": "lm-eval", "model": model_name, "data_file": str(path),
            "data_sha256": file_sha256(path), "context": context, "num_examples": n,
            "num_examples_in_file": len(texts), "num_correct": correct, "accuracy": correct / n,
            "num_correct_last_token": sum(last for _, _, last in scored),
            "accuracy_last_token": sum(last for _, _, last in scored) / n, "num_target_tokens": tokens,
            "nll_sum": nll, "ppl": safe_exp(nll / n), "ppl_per_token": safe_exp(nll / tokens),
            "lm_eval": {"acc": correct / n, "perplexity": safe_exp(nll / n)}}


def wikitext_pages(raw: str) -> list[str]:
    """The raw file's pages: a new page starts at each top-level heading line (" = Title = ")."""
    pages, lines = [], []
    for line in raw.split("\n"):
        heading = line.replace("= = =", "===").replace("= =", "==").strip()
        if heading.startswith("= ") and heading.endswith(" ="):
            if "\n".join(lines).strip():
                pages.append("\n".join(lines))
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return pages


def rolling_windows(tokens: list[int], prefix_id: int, max_length: int) -> list[Pair]:
    """lm-eval's disjoint rolling windows (context_len 1): the first predicts tokens[:L] from the prefix and its
    own tokens; each later one predicts the next L (the last one fewer, with a full context)."""
    windows, done = [], 0
    if not tokens:
        return windows
    first = min(max_length, len(tokens))
    windows.append(([prefix_id], tokens[:first]))  # input [prefix] + tokens[:first - 1]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_length)
        end = done + n
        windows.append((tokens[end - max_length - 1:end - n], tokens[end - n:end]))
        done = end
    return windows


def evaluate_wikitext(logits_fn: LogitsFn, path: str, tokenizer, *, context: int, pad_id: int,
                      batch_size: int = 4, limit: int | None = None, progress: bool = False,
                      model_name: str = "model") -> dict:
    pages = wikitext_pages(read_text_file(path, "WikiText"))
    chosen = pages if limit is None else pages[:limit]
    windows, owner = [], []
    for index, page in enumerate(chosen):
        for window in rolling_windows(tokenizer.encode(wikitext_detokenize(page)), tokenizer.eod_id, context):
            windows.append(window)
            owner.append(index)
    scored = score_pairs(logits_fn, windows, max_length=context, pad_id=pad_id, batch_size=batch_size,
                         progress=progress, desc="wikitext (lm-eval)")
    ll = sum(s[0] for s in scored)
    words = sum(len(re.split(r"\s+", page)) for page in chosen)
    num_bytes = sum(len(page.encode("utf-8")) for page in chosen)
    tokens = sum(len(cont) for _, cont in windows)
    return {"task": "wikitext103", "protocol": "lm-eval", "model": model_name, "data_file": str(path),
            "data_sha256": file_sha256(path), "context": context, "num_pages": len(chosen),
            "num_pages_in_file": len(pages), "num_words": words, "num_bytes": num_bytes,
            "num_scored_tokens": tokens, "num_windows": len(windows), "nll_sum": -ll, "avg_nll": -ll / tokens,
            "ppl": safe_exp(-ll / tokens), "adjusted_ppl": safe_exp(-ll / words),
            "word_perplexity": safe_exp(-ll / words), "byte_perplexity": safe_exp(-ll / num_bytes),
            "bits_per_byte": -ll / num_bytes / math.log(2),
            "lm_eval": {"word_perplexity": safe_exp(-ll / words), "byte_perplexity": safe_exp(-ll / num_bytes),
                        "bits_per_byte": -ll / num_bytes / math.log(2)}}


def summary_line(result: dict) -> str:
    if result["task"] == "lambada":
        return (f"lambada (lm-eval) | {result['model']} | acc {result['accuracy']:.4f} ({result['num_correct']:,}/"
                f"{result['num_examples']:,}) | perplexity {result['ppl']:.4f}")
    return (f"wikitext (lm-eval) | {result['model']} | word_perplexity {result['word_perplexity']:.4f} "
            f"| byte_perplexity {result['byte_perplexity']:.6f} | bits_per_byte {result['bits_per_byte']:.6f} "
            f"| pages {result['num_pages']} | words {result['num_words']:,}")
