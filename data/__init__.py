"""Data for megazoo: tokenizers, the stdlib demo corpus, fixed-length token samples and the batch sampler."""

from data.batches import GlobalBatchSampler
from data.stdlib_corpus import split_train_val, stdlib_documents
from data.token_dataset import DemoCorpus, TokenSamples, build_stdlib_corpus, synthetic_tokens
from data.tokenizer import EOD_TOKEN, BPETokenizer, Tokenizer

__all__ = [
    "EOD_TOKEN",
    "BPETokenizer",
    "DemoCorpus",
    "GlobalBatchSampler",
    "TokenSamples",
    "Tokenizer",
    "build_stdlib_corpus",
    "split_train_val",
    "stdlib_documents",
    "synthetic_tokens",
]
