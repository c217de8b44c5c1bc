"""Evaluation: WikiText-103 perplexity, LAMBADA accuracy (see the evaluation issue)."""
