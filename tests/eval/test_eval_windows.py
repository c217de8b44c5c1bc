"""The WikiText window schedule and the metric arithmetic, checked with hand-made logits functions."""

from __future__ import annotations

import math

import pytest
import torch

from megazoo.eval.lambada import LambadaData, LambadaExample, evaluate_lambada
from megazoo.eval.wikitext103 import WikiTextData, evaluate_wikitext, window_schedule

V, HIT_LOGIT = 10, 5.0  # scores are fp32 cross-entropies: compared with rel 1e-6
NLL_HIT = -math.log(math.exp(HIT_LOGIT) / (math.exp(HIT_LOGIT) + V - 1))
NLL_MISS = -math.log(1.0 / (math.exp(HIT_LOGIT) + V - 1))


def successor_logits(ids: torch.Tensor) -> torch.Tensor:
    """A 'model' that always predicts token (id + 1) mod V, with logit 5 for it and 0 for the rest."""
    logits = torch.zeros(*ids.shape, V)
    logits.scatter_(-1, ((ids + 1) % V).unsqueeze(-1), HIT_LOGIT)
    return logits


@pytest.mark.parametrize("num_tokens", [2, 50, 129, 130, 1000, 1027])
@pytest.mark.parametrize("context,stride", [(128, 32), (128, 128), (128, 1), (16, 5), (7, 3), (1, 1)])
def test_every_token_scored_exactly_once(num_tokens, context, stride):
    schedule = window_schedule(num_tokens, context, stride)
    scored = [w.start + j + 1 for w in schedule for j in range(w.first_scored, w.end_scored)]
    assert scored == list(range(1, num_tokens))  # each target once, in order
    for w in schedule:
        assert w.num_scored >= 1
        assert w.start + w.end_scored <= num_tokens - 1
        if w.index > 0:  # a later window predicts with at least W - s tokens of context
            assert w.first_scored == context - stride and w.start == w.index * stride


def test_window_count_and_bad_arguments():
    assert len(window_schedule(270_330, 1024, 32)) == 1 + math.ceil((270_329 - 1024) / 32)
    with pytest.raises(ValueError, match="stride 0"):
        window_schedule(100, 16, 0)
    with pytest.raises(ValueError, match="stride 17"):
        window_schedule(100, 16, 17)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        window_schedule(1, 16, 4)


def test_wikitext_metrics_on_a_known_model():
    # Tokens 0,1,2,... mod V are predicted perfectly except after each 7 (where 9 follows instead of 8).
    tokens = [i % V for i in range(203)]
    tokens = [9 if prev == 7 else t for prev, t in zip([None] + tokens, tokens)]
    data = WikiTextData("synthetic", "0" * 64, tokens, num_original_tokens=150)
    result = evaluate_wikitext(successor_logits, data, context=16, stride=4, pad_id=0, batch_size=3)
    misses = sum(1 for prev, t in zip(tokens, tokens[1:]) if t != (prev + 1) % V)
    expected_nll = misses * NLL_MISS + (202 - misses) * NLL_HIT
    assert result["num_scored_tokens"] == 202 and result["complete"]
    assert result["nll_sum"] == pytest.approx(expected_nll, rel=1e-6)
    assert result["ppl"] == pytest.approx(math.exp(expected_nll / 202), rel=1e-6)
    assert result["adjusted_ppl"] == pytest.approx(math.exp(expected_nll / 149), rel=1e-6)
    limited = evaluate_wikitext(successor_logits, data, context=16, stride=4, pad_id=0, limit=2)
    assert limited["num_windows"] == 2 and limited["num_scored_tokens"] == 16 + 4 and not limited["complete"]


def test_lambada_metrics_on_a_known_model():
    examples = [
        LambadaExample([1, 2, 3], [4, 5]),  # both target tokens right: correct, last token right
        LambadaExample([1, 2, 3], [4, 6]),  # first right, last wrong
        LambadaExample([5, 2, 3], [9, 0]),  # first wrong, last right: not correct, last token right
        LambadaExample([8], [9]),  # one-token target, right
        LambadaExample([i % V for i in range(30)], [0]),  # context longer than the window: left-truncated, still right
    ]
    data = LambadaData("synthetic", "0" * 64, examples)
    result = evaluate_lambada(successor_logits, data, context=8, pad_id=0, batch_size=2)
    assert (result["num_correct"], result["num_correct_last_token"], result["num_examples"]) == (3, 4, 5)
    word_nll = [2 * NLL_HIT, NLL_HIT + NLL_MISS, NLL_MISS + NLL_HIT, NLL_HIT, NLL_HIT]
    assert result["nll_sum"] == pytest.approx(sum(word_nll), rel=1e-6)
    assert result["ppl"] == pytest.approx(math.exp(sum(word_nll) / 5), rel=1e-6)
    assert result["ppl_per_token"] == pytest.approx(math.exp(sum(word_nll) / 8), rel=1e-6)
    assert result["accuracy"] == pytest.approx(0.6) and result["accuracy_last_token"] == pytest.approx(0.8)
    assert evaluate_lambada(successor_logits, data, context=8, pad_id=0, limit=1)["num_examples"] == 1
