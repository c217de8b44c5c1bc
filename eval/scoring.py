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
from megazoo.parallel.tensor import gather_from_tp_region

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # ids (b, s) long -> logits (b, s, V) float


def gpt_logits_fn(model) -> LogitsFn:
    """Full-vocabulary logits of our GPT (whole model, pp = 1) at any tp.

    Each rank computes its vocabulary shard (b, s, V_padded / tp); the shards are all-gathered over tp and the
    padding columns dropped. Every tp rank must call it with the same ids (collective), and then holds the same
    logits, so all ranks compute identical metrics.
    """
    if not (model.with_embedding and model.with_head):
        raise ValueError("evaluation needs the whole model on each rank (pipeline parallelism is not supported)")
    model.eval()

    @torch.no_grad()
    def logits(ids: torch.Tensor) -> torch.Tensor:
        local = model(ids.to(model.topo.device))  # (b, s, V_padded / tp)
        return gather_from_tp_region(local, model.topo.tp_group)[..., : model.cfg.vocab_size]

    return logits


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
