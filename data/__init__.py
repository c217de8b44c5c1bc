"""Data for megazoo: tokenizers, the stdlib demo corpus, fixed-length token samples and the batch sampler."""

from megazoo.data.batches import GlobalBatchSampler
from megazoo.data.stdlib_corpus import split_train_val, stdlib_documents
from megazoo.data.token_dataset import DemoCorpus, TokenSamples, build_stdlib_corpus, synthetic_tokens
from megazoo.data.tokenizer import EOD_TOKEN, BPETokenizer, Tokenizer

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

# Indexed datasets (Megatron-style .bin/.idx), GPT samples over them, and blending.
from megazoo.data.blending import BlendedDataset, blend_counts, blend_order  # noqa: E402
from megazoo.data.gpt_dataset import GPTDataset  # noqa: E402
from megazoo.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter  # noqa: E402
# data.preprocess is not imported here: a `preprocess` name in the package would shadow the submodule, and
# `python -m megazoo.data.preprocess` warns when the package has imported it already. Import it from data.preprocess.

__all__ += [
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "blend_counts",
    "blend_order",
]

# Every kind of tokenizer behind the Tokenizer protocol, and the one loader for a user's tokenizer spec.
from megazoo.data.gpt2_bpe import GPT2BPETokenizer  # noqa: E402
from megazoo.data.sentencepiece_tokenizer import SentencePieceTokenizer  # noqa: E402
from megazoo.data.tokenizer import HFTokenizer  # noqa: E402
from megazoo.data.tokenizer_loading import load_tokenizer  # noqa: E402

__all__ += ["GPT2BPETokenizer", "HFTokenizer", "SentencePieceTokenizer", "load_tokenizer"]
