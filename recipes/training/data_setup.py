"""Where the training loop's samples come from: the stdlib demo corpus, indexed datasets, synthetic tokens.

Rank 0 builds the caches under run.dir first (tokenizer and tokens for the stdlib corpus, sample indices for
indexed data); the other ranks wait at a barrier and then load them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megazoo.data.token_dataset import TokenSamples, build_stdlib_corpus, synthetic_tokens
from megazoo.data.tokenizers.tokenizer import Tokenizer
from megazoo.data.blending import BlendedDataset, blend_counts
from megazoo.data.gpt_dataset import GPTDataset
from megazoo.data.indexed.formats import open_indexed
from megazoo.data.sft.dataset import SFTDataset
from megazoo.data.sft.packing import SFTRows
from megazoo.data.tokenizers.loading import load_tokenizer
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import Resolved

# anything with len() and stack(indices) -> (n, seq + 1); SFTRows: batch(indices) -> (inputs, targets, segments)
Samples = TokenSamples | GPTDataset | BlendedDataset | SFTRows


@dataclass(frozen=True)
class TrainData:
    train: Samples
    val: Samples | None  # None: no validation data
    tokenizer: Tokenizer | None = None


def _rank0_first(topo: Topology, build):
    """Run `build` on rank 0 first (it fills caches), then on the others: no rank repeats the expensive part."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        result = build() if topo.rank == 0 else None
        dist.barrier()
        return result if result is not None else build()
    return build()


def _indexed_samples(prefixes, weights, seq: int, seed: int, num_samples: int, cache: Path):
    """GPT samples from one indexed dataset, or an exact, deterministic blend of several."""
    if len(prefixes) == 1:
        return GPTDataset(open_indexed(prefixes[0]), seq, seed, num_samples=num_samples, cache_dir=cache)
    weights = list(weights) or [1.0] * len(prefixes)
    counts = blend_counts(weights, num_samples)
    parts = [GPTDataset(open_indexed(p), seq, seed, num_samples=max(1, n), cache_dir=cache)
             for p, n in zip(prefixes, counts)]
    return BlendedDataset(parts, weights, num_samples, seed, cache_dir=cache)


def _tokens_per_pass(samples: Samples) -> int:
    """Distinct training tokens behind `samples` (one pass over the corpus)."""
    if isinstance(samples, GPTDataset):
        return samples.tokens_per_epoch
    if isinstance(samples, BlendedDataset):
        return sum(_tokens_per_pass(part) for part in samples.datasets)
    return len(samples) * samples.seq_len  # TokenSamples: non-overlapping windows of its token stream


def repeat_warning(res: Resolved, samples: Samples) -> str | None:
    """A line saying how many times the run reads its training data over (None within one pass): a tiny corpus
    trains by repeating itself, which a user should hear before the loss looks suspiciously good."""
    needed = res.recipe.train.steps * res.global_batch * res.recipe.train.seq_len
    corpus = max(1, _tokens_per_pass(samples))
    if needed <= corpus:
        return None
    return (f"the training data holds {corpus:,} tokens, but {res.recipe.train.steps} steps x {res.global_batch} "
            f"sequences x {res.recipe.train.seq_len} tokens = {needed:,} tokens: it is read about "
            f"{needed / corpus:,.1f} times over (epochs); add data or shorten train.steps")


def check_validation_split(val, topo: Topology) -> None:
    """Validation splits its samples over the dp ranks (Trainer.evaluate): each rank needs one at least."""
    if val is not None and topo.dp > 1 and len(val) < topo.dp:
        raise RecipeError(f"the validation data holds {len(val)} sample(s), fewer than the {topo.dp} data-parallel "
                          f"ranks that evaluate it; valid: at least {topo.dp} validation samples (more validation "
                          "data, a longer data.val_fraction / sft.valid_path) or no validation data")


def load_data(res: Resolved, topo: Topology) -> TrainData:
    data = _load_data(res, topo)
    check_validation_split(data.val, topo)
    return data


def _load_data(res: Resolved, topo: Topology) -> TrainData:
    """The recipe's corpus as fixed-length samples. Rank 0 builds the caches under run.dir (tokenizer and tokens
    for the stdlib corpus, sample indices for indexed data) first; the other ranks then load them."""
    data, train = res.recipe.data, res.recipe.train
    seq, seed = train.seq_len, train.seed
    cache = Path(res.recipe.run.dir) / "data_cache"
    sft = res.recipe.sft
    if sft.path:  # fine-tuning rows (recipes/sft_section.py): response-only targets, packed or padded
        train_rows = SFTRows(SFTDataset(sft.path), seq, sft.packing)
        val_rows = SFTRows(SFTDataset(sft.valid_path), seq, sft.packing) if sft.valid_path else None
        return TrainData(train_rows, val_rows, load_tokenizer(data.tokenizer) if data.tokenizer else None)
    if data.source == "synthetic":
        n_val = max(seq + 1, data.synthetic_tokens // 10)
        tokens = synthetic_tokens(data.synthetic_tokens + n_val, res.model.vocab_size, seed)
        return TrainData(TokenSamples(tokens[:-n_val], seq), TokenSamples(tokens[-n_val:], seq))
    if data.source == "indexed":
        def build():
            train_set = _indexed_samples(data.paths, data.weights, seq, seed, train.steps * res.global_batch, cache)
            val_set = _indexed_samples(data.valid_paths, (), seq, seed, train.eval_batches * res.global_batch,
                                       cache) if data.valid_paths else None
            return train_set, val_set
        train_set, val_set = _rank0_first(topo, build)
        tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer else None
    else:
        corpus = _rank0_first(topo, lambda: build_stdlib_corpus(cache, data.vocab_size, data.max_bytes,
                                                                data.val_fraction, seed=0))
        train_set, val_set = TokenSamples(corpus.train_tokens, seq), TokenSamples(corpus.val_tokens, seq)
        tokenizer = corpus.tokenizer
    warning = repeat_warning(res, train_set)
    if warning and topo.rank == 0:
        print(f"megazoo: warning: {warning}", file=sys.stderr, flush=True)
    if tokenizer is not None and tokenizer.vocab_size > res.model.vocab_size:
        raise RecipeError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
                          f"{res.model.vocab_size}; valid: model.vocab_size >= {tokenizer.vocab_size}")
    return TrainData(train_set, val_set, tokenizer)
