"""What every evaluation shares: the LogitsFn interface, per-token scoring, data-file checks, result files.

An evaluation never touches a model directly: it calls a `LogitsFn`, ids (b, s) -> full logits (b, s, V) over
the true vocabulary. `gpt_logits_fn` adapts our (tensor-parallel) GPT, `hf_logits_fn` a transformers
GPT2LMHeadModel, so one eval code path scores both and their numbers can be compared directly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from megazoo.data.fileio import atomic_write_text
from megazoo.models.generation.generate import full_logits
from megazoo.parallel.collectives import all_gather_stacked

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # ids (b, s) long -> logits (b, s, V) float


def gpt_logits_fn(model) -> LogitsFn:
    """Full-vocabulary logits of our GPT (whole model, pp = 1) at any tp and ep (`gpt_forward`).

    Each rank computes its vocabulary shard (b, s, V_padded / tp); the shards are all-gathered over tp and the
    padding columns dropped. Every rank must call it with the same ids (collective), and then holds the same
    logits, so all ranks compute identical metrics.
    """
    if not (model.with_embedding and model.with_head):
        raise ValueError("evaluation needs the whole model on each rank (pipeline parallelism is not supported)")
    model.eval()

    @torch.no_grad()
    def logits(ids: torch.Tensor) -> torch.Tensor:
        return gpt_forward(model, ids)

    return logits


def gpt_forward(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    """Logits (b, s, V) of ids (b, s) on every rank, every rank calling with the same ids.

    At ep > 1 without a cache the rows are split over the ep ranks: each runs ceil(b / ep) of them (the last row
    repeated to fill the last rank's share), the MoE layers send each token to its experts' ranks by all-to-all as
    in training, and the logits are all-gathered over the ep group. So ep splits the work as it splits the experts'
    memory, and every rank holds the same logits. Not with a capacity factor: it caps an expert's rows per rank,
    so which tokens drop would depend on the split (every rank then runs every row), nor when decoding (a cache
    holds its rows' past: every rank runs the whole batch).
    """
    topo = model.topo
    if cache is not None or topo.ep_group is None or model.cfg.moe_capacity_factor:
        return full_logits(model, ids, cache)
    rows, per = ids.shape[0], -(-ids.shape[0] // topo.ep)
    filled = torch.cat([ids, ids[-1:].expand(per * topo.ep - rows, -1)])
    mine = full_logits(model, filled[topo.ep_rank * per:(topo.ep_rank + 1) * per])
    return all_gather_stacked(mine, topo.ep_group, topo.ep).flatten(0, 1)[:rows]


def hf_logits_fn(hf_model) -> LogitsFn:
    """Logits of a transformers causal LM (e.g. GPT2LMHeadModel), in eval mode."""
    hf_model.eval()
    device = next(hf_model.parameters()).device

    @torch.no_grad()
    def logits(ids: torch.Tensor) -> torch.Tensor:
        return hf_model(input_ids=ids.to(device)).logits

    return logits


def score_targets(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position negative log-likelihood (float64) of `targets` and whether greedy decoding predicts them.

    logits (b, s, V), targets (b, s) -> nll (b, s), correct (b, s) bool. Cross-entropy runs in float32 (or
    wider) per position; sums are taken in float64 by the caller so long files do not lose precision.
    """
    logits = logits.float()
    nll = F.cross_entropy(logits.transpose(1, 2), targets.to(logits.device), reduction="none")
    correct = logits.argmax(dim=-1) == targets.to(logits.device)
    return nll.double().cpu(), correct.cpu()


def safe_exp(x: float) -> float:
    """exp that returns inf instead of raising on overflow (an untrained model's perplexity can be huge)."""
    try:
        return math.exp(x)
    except OverflowError:
        return float("inf")


def read_text_file(path: str | Path, what: str) -> str:
    """A UTF-8 text file's contents, or an error naming the path and what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} not found")
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{what} file {path} is empty")
    try:
        # Bytes, decoded: no newline translation, so the text is exactly the file (as Megatron reads it).
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} file {path} is not UTF-8 text (corrupt or the wrong file?): {error}") from error


def write_result_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")


def batches(items: list, batch_size: int):
    """Consecutive slices of `items` of at most batch_size."""
    if batch_size < 1:
        raise ValueError(f"batch size {batch_size} is invalid: it must be a positive integer")
    for start in range(0, len(items), batch_size):
        yield items[start:start + batch_size]
