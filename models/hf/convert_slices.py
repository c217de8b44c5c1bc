"""`megazoo convert ... --verify`: a WikiText slice and a LAMBADA slice scored through both sides of a conversion.

The fixed sample of convert_verify.py holds the logits of 2 x 64 random ids to 1e-10; it cannot see what only real
text or long positions exercise (e.g. position embeddings past the sample's 64 tokens, a vocabulary row real text
uses). Here the same two models (megazoo's GPT and the transformers model loaded from the HF directory, both
fp64) score:
- WikiText: the first `wikitext_tokens` GPT-2 BPE tokens of wiki.test.raw (the raw text, no detokenizer: both
  sides see the same ids), in consecutive windows of W + 1 tokens (W = min(n_positions, 256)) sharing one token,
  every token but the first scored once: perplexity = exp(mean next-token NLL);
- LAMBADA: the first `lambada_items` passages of lambada_test.jsonl: context = the text before the last word,
  target = BPE(" " + last word), left-truncated to W + 1 tokens; strict accuracy (greedy right at every target
  token) and the target word's perplexity (exp of the mean summed NLL).
Tolerances (fp64: two correct implementations agree to ~1e-13 on these means): perplexities relative 1e-10,
LAMBADA correct count exactly equal. For a family whose transformers implementation rounds to fp32 (RMSNorm,
rotary: convert_verify.py's docstring) the megazoo side is also scored in fp32, and the tolerances become
2 x that fp32-vs-fp64 deviation (perplexities) and the number of LAMBADA items fp32 and fp64 count differently.

The ids are GPT-2 BPE ids (data/tokenizers/gpt2_bpe.py), so a model with a smaller vocabulary is not scored (one line says so);
for a larger one (e.g. a Llama family model) the two sides are still held to the same function of the same ids.
The data is looked up as the catalog lays it out (data/published/catalog.py: FOLDER/wikitext103, FOLDER/lambada,
FOLDER/gpt2_bpe). eval/ is a layer above models/, so the few lines of window and last-word logic are repeated
here in their simplest form rather than imported from eval/wikitext103.py and eval/lambada.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from megazoo.data.published.catalog import find_item
from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer

PPL_RTOL = 1e-10
FLOOR_FACTOR = 2.0  # as convert_verify.py's
MAX_WINDOW = 256
GPT2_VOCAB = 50_257

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # ids (1, s) -> fp64 logits (1, s, V)


@dataclass(frozen=True)
class SliceData:
    folder: str
    wikitext: list[int]  # GPT-2 BPE ids of the start of wiki.test.raw
    lambada: list[tuple[list[int], list[int]]]  # (context ids, target ids) per passage


@dataclass(frozen=True)
class SliceScore:
    wikitext_ppl: float
    wikitext_scored: int
    lambada_correct: int
    lambada_items: int
    lambada_ppl: float


def find_slice_data(folders: Sequence[str | Path]) -> Path | None:
    """The first of `folders` that holds wikitext103/, lambada/ and gpt2_bpe/ (every catalog file), else None."""
    for folder in folders:
        if all(find_item(name, [folder]) is not None for name in ("wikitext103", "lambada", "gpt2-bpe")):
            return Path(folder)
    return None


def load_slices(folder: str | Path, wikitext_tokens: int, lambada_items: int) -> SliceData:
    if wikitext_tokens < 2 or lambada_items < 1:
        raise ValueError(f"--verify-tokens must be >= 2 (got {wikitext_tokens}) and --verify-lambada >= 1 "
                         f"(got {lambada_items})")
    folder = Path(folder)
    tokenizer = GPT2BPETokenizer.from_dir(find_item("gpt2-bpe", [folder]))
    raw = (find_item("wikitext103", [folder]) / "wiki.test.raw").read_text(encoding="utf-8")
    # ~4 characters per GPT-2 token on English text: 8 per token is ample, and a short file is read whole
    wikitext = tokenizer.encode(raw[: 8 * wikitext_tokens + 64])[: wikitext_tokens]
    lambada = []
    lines = (find_item("lambada", [folder]) / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()
    for line in [line for line in lines if line.strip()][:lambada_items]:
        text = json.loads(line)["text"]
        last = text.split()[-1]
        lambada.append((tokenizer.encode(text[: text.rfind(last)].strip()), tokenizer.encode(" " + last)))
    return SliceData(str(folder), wikitext, lambada)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.double(), targets, reduction="none")


@torch.no_grad()
def score_slices(logits_fn: LogitsFn, data: SliceData, n_positions: int) -> SliceScore:
    window = min(n_positions, MAX_WINDOW)
    ids = torch.tensor(data.wikitext, dtype=torch.long)
    nll_sum, scored = 0.0, 0
    for start in range(0, len(ids) - 1, window):  # window k: inputs ids[kW : kW+W], targets one later
        piece = ids[start: start + window + 1]
        nll_sum += _nll(logits_fn(piece[None, :-1])[0], piece[1:]).sum().item()
        scored += len(piece) - 1
    correct, word_nll = 0, 0.0
    for context, target in data.lambada:
        seq = torch.tensor((context + target)[-(window + 1):], dtype=torch.long)
        logits = logits_fn(seq[None, :-1])[0, -len(target):]
        wanted = seq[-len(target):]
        correct += bool((logits.argmax(-1) == wanted).all())
        word_nll += _nll(logits, wanted).sum().item()
    return SliceScore(math.exp(nll_sum / scored), scored, correct, len(data.lambada),
                      math.exp(word_nll / len(data.lambada)))


@dataclass(frozen=True)
class SliceComparison:
    megazoo: SliceScore
    hf: SliceScore
    folder: str  # where the data came from
    floor: SliceScore | None = None  # the megazoo side scored in fp32: the tolerances' floor (module docstring)

    def _tolerances(self) -> tuple[float, float, float]:
        if self.floor is None:
            return PPL_RTOL, 0.0, PPL_RTOL
        ours, low = self.megazoo, self.floor
        rel = lambda a, b: abs(a - b) / abs(b)  # noqa: E731
        return (max(PPL_RTOL, FLOOR_FACTOR * rel(low.wikitext_ppl, ours.wikitext_ppl)),
                abs(low.lambada_correct - ours.lambada_correct) / ours.lambada_items,
                max(PPL_RTOL, FLOOR_FACTOR * rel(low.lambada_ppl, ours.lambada_ppl)))

    def rows(self) -> list[tuple[str, float, float, float, float]]:
        """(quantity, megazoo, HF, deviation, tolerance) per compared figure."""
        ours, theirs = self.megazoo, self.hf
        rel = lambda a, b: abs(a - b) / max(abs(b), 1e-300) if a == a and b == b else float("inf")  # noqa: E731
        wiki_tol, lambada_tol, word_tol = self._tolerances()
        return [(f"WikiText ppl ({ours.wikitext_scored} tokens, rel)", ours.wikitext_ppl, theirs.wikitext_ppl,
                 rel(ours.wikitext_ppl, theirs.wikitext_ppl), wiki_tol),
                (f"LAMBADA accuracy ({ours.lambada_items} items, abs)", ours.lambada_correct / ours.lambada_items,
                 theirs.lambada_correct / theirs.lambada_items,
                 abs(ours.lambada_correct - theirs.lambada_correct) / ours.lambada_items, lambada_tol),
                ("LAMBADA target-word ppl (rel)", ours.lambada_ppl, theirs.lambada_ppl,
                 rel(ours.lambada_ppl, theirs.lambada_ppl), word_tol)]

    @property
    def passed(self) -> bool:
        return all(dev <= tol for _, _, _, dev, tol in self.rows())

    def table(self) -> str:
        lines = [f"verify: a WikiText slice and a LAMBADA slice ({self.folder}) scored through megazoo and through "
                 "transformers, fp64",
                 f"  {'quantity':<40}{'megazoo':>16}{'HF':>16}{'deviation':>12}{'tolerance':>11}  result"]
        lines += [f"  {name:<40}{a:>16.10g}{b:>16.10g}{dev:>12.2e}{tol:>11.2e}  {'pass' if dev <= tol else 'FAIL'}"
                  for name, a, b, dev, tol in self.rows()]
        return "\n".join(lines)
