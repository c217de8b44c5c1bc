"""Autoregressive decoding of a (tensor-parallel) GPT with a KV cache: every rank runs the same loop.

The prompt is run once, filling the cache (models/generation/kv_cache.py); each new token is then a forward of one
position. The vocabulary-sharded logits of the last position are all-gathered over tp (one row, small), and the
draw uses a generator seeded identically on every rank, so all tp ranks pick the same token and their caches
(each holding its own heads) stay in step. Used by `megazoo generate`, the trainer's closing sample
(recipes/training/sample.py) and lm-eval's generate_until (eval/harness_model.py). Under expert parallelism
each ep rank computes its own logits, and the token the first ep rank picks is broadcast over the ep group.

Past the model's context (n_positions) the window slides: the cache is dropped and the last n_positions tokens
are recomputed at every step, exactly what a cache-less loop over `ids[-n_positions:]` computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.generation.kv_cache import KVCache
from megazoo.models.generation.latent_cache import LatentCache
from megazoo.models.transformer import GPT
from megazoo.parallel.expert import from_first_rank
from megazoo.parallel.tensor import gather_from_tp_region


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Refuse sampling settings that mean nothing, naming the value and what is valid."""
    if not temperature >= 0:
        raise ValueError(f"temperature {temperature} is invalid: use 0 (greedy) or a positive number")
    if top_k < 0:
        raise ValueError(f"top_k {top_k} is invalid: use 0 (off) or a positive number of tokens")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p {top_p} is invalid: use a probability in (0, 1] (1 is off)")


def check_decodable(model: GPT) -> None:
    """The KV cache attends densely over this rank's whole sequence: no block-sparse pattern, no cp split."""
    if getattr(model.cfg, "attention", "dense") != "dense" or getattr(model.topo, "cp", 1) > 1:
        raise ValueError(f"decoding with a KV cache needs dense attention at cp = 1 (model.attention = "
                         f"{getattr(model.cfg, 'attention', 'dense')!r}, cp = {getattr(model.topo, 'cp', 1)})")


def new_cache(cfg: ModelConfig, capacity: int | None = None) -> KVCache | LatentCache:
    """The decoding cache a model takes: latent attention's LatentCache (c_kv and k_pe only, the up-projections
    absorbed at decode time), else the per-head KVCache. `capacity` defaults to the model's context."""
    capacity = capacity or cfg.n_positions
    return LatentCache(capacity) if cfg.mla else KVCache(capacity)


def full_logits(model: GPT, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """Logits over the true vocabulary (b, s, V) on every tp rank: the shards all-gathered, padding dropped."""
    local = model(ids.to(model.topo.device), cache=cache)  # (b, s, V_padded / tp)
    return gather_from_tp_region(local, model.topo.tp_group)[..., : model.cfg.vocab_size]


def pick(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
         draw: torch.Generator) -> torch.Tensor:
    """Next token ids (b, 1) from last-position logits (b, V): argmax at temperature 0, else a draw from the
    softmax of logits / temperature restricted to the top_k tokens and then to the top_p probability mass."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays).
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=draw)


@torch.no_grad()
def decode(model: GPT, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, stop: Callable[[list[int]], bool] | None = None,
           forward: Callable[[torch.Tensor, KVCache], torch.Tensor] | None = None,
           cache: KVCache | LatentCache | None = None) -> list[int]:
    """prompt + up to max_new_tokens new ids. `stop(new_ids)` is asked after each token (e.g. "was it EOS?");
    decoding ends when it says so, with that token kept. Collective under tp and ep: every rank calls it alike.
    `forward(ids, cache)` -> full logits replaces `full_logits(model, ids, cache)` (the lm-eval adapter's rank 0
    uses it to have the other tp / ep ranks run the same forward: this rank alone picks the tokens). `cache`: an
    empty cache to fill (new_cache's by default; a KVCache for latent attention decodes with full per-head keys
    and values, the reference), left holding the last window for the caller to read (bytes_per_token)."""
    check_sampling(temperature, top_k, top_p)
    check_decodable(model)
    if not prompt:
        raise ValueError("the prompt encodes to no tokens: give at least one token of text")
    was_training = model.training
    model.eval()
    draw = torch.Generator().manual_seed(seed)
    context = model.cfg.n_positions
    ids = list(prompt)
    cache = cache if cache is not None else new_cache(model.cfg, context)
    fresh = ids[-context:]  # positions the cache does not hold yet
    try:
        for _ in range(max_new_tokens):
            if cache.length + len(fresh) > context:  # past the context: slide (recompute the last window)
                cache.reset()
                fresh = ids[-context:]
            ids_in = torch.tensor([fresh], dtype=torch.long)
            logits = (forward(ids_in, cache) if forward is not None else full_logits(model, ids_in, cache))
            logits = logits[:, -1, :].float().cpu()
            nxt = pick(logits, temperature=temperature, top_k=top_k, top_p=top_p, draw=draw)[0, 0]
            if forward is None:  # every rank decodes: at ep > 1 the first ep rank's token on every rank
                nxt = from_first_rank(nxt.to(model.topo.device), model.topo.ep_group)  # (comms.py says why)
            nxt = int(nxt)
            ids.append(nxt)
            fresh = [nxt]
            if stop is not None and stop(ids[len(prompt):]):
                break
    finally:
        model.train(was_training)
    return ids
