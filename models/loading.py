"""A checkpoint as a ready model: its step directory, config and tokenizer, and this rank's shards of its weights.

`open_checkpoint(path, tokenizer=None)` resolves a run's `checkpoints/` folder (its latest good checkpoint) or one
`step_N` directory and reads what the checkpoint knows without touching the weights: the model config, the step
and the tokenizer (an explicit `tokenizer` spec wins; else the one the checkpoint records, data/tokenizers/store.py).
`load_gpt(ckpt, topology)` builds a whole (pp = 1) GPT for this rank and fills its tensor-parallel shards straight
from the sharded files (parallel/checkpoint/load.py assembles one parameter at a time and keeps this rank's
shard), so a tp > 1 job never holds the consolidated model on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megazoo.data.tokenizers.tokenizer import Tokenizer
from megazoo.models.config import ModelConfig
from megazoo.models.transformer import GPT
from megazoo.parallel.checkpoint.consolidate import resolve_checkpoint
from megazoo.parallel.checkpoint.io import CheckpointError, read_common, verify_checkpoint
from megazoo.parallel.checkpoint.load import load_views
from megazoo.parallel.checkpoint.views import whole_param_views
from megazoo.parallel.tensor import named_shards
from megazoo.parallel.topology import Topology


@dataclass(frozen=True)
class OpenCheckpoint:
    path: Path  # the step directory
    step: int
    cfg: ModelConfig
    tokenizer: Tokenizer | None  # None: neither given nor recorded
    skipped: tuple[str, ...] = ()  # newer checkpoints that did not verify, each with the reason


def model_config(common: dict, path: Path) -> ModelConfig:
    try:
        return ModelConfig(**common["model"])
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path}: model config is corrupt: {error!r}") from error


def open_checkpoint(path: str | Path, tokenizer: str | Path | None = None, *, need_tokenizer: bool = True,
                    report=print, verify: bool = False) -> OpenCheckpoint:
    """Resolve `path`, read its config and tokenizer; refuse a tokenizer whose vocabulary the model lacks.

    A run's checkpoints folder resolves to its newest checkpoint that verifies; when a newer one is damaged, that
    is never silent: `report` hears each one skipped and which checkpoint is used, and `skipped` records them.
    `verify`: also check every file of a step directory named directly (sizes and sha256)."""
    from megazoo.data.tokenizers.loading import load_tokenizer
    from megazoo.data.tokenizers.store import checkpoint_tokenizer

    problems: list[str] = []
    step_dir = resolve_checkpoint(path, report=report, problems=problems).resolve()
    if problems:
        report(f"megazoo: using checkpoint {step_dir}: the newest that verifies ({len(problems)} newer skipped)")
    elif verify:
        verify_checkpoint(step_dir)
    common = read_common(step_dir)
    cfg = model_config(common, step_dir)
    tok = load_tokenizer(tokenizer) if tokenizer else checkpoint_tokenizer(common, step_dir)
    if tok is None and need_tokenizer:
        raise FileNotFoundError(f"checkpoint {step_dir} records no tokenizer (it was not trained by a megazoo "
                                "recipe with one): pass --tokenizer (a GPT-2 BPE directory, a tokenizer .json, "
                                "a sentencepiece .model or hf:NAME)")
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        where = tokenizer if tokenizer else f"recorded in {step_dir}"
        raise ValueError(f"the model's vocabulary ({cfg.vocab_size} ids, {step_dir}) does not match the tokenizer "
                         f"{where} ({tok.vocab_size} ids): pass the model's own --tokenizer")
    return OpenCheckpoint(step_dir, common["step"], cfg, tok, tuple(problems))


def load_gpt(ckpt: OpenCheckpoint, topology: Topology, dtype: torch.dtype = torch.float32) -> GPT:
    """This rank's whole (pp = 1) GPT at `topology`'s tp, its shards read from the checkpoint, in eval mode."""
    model = GPT(ckpt.cfg, topology, device=topology.device, dtype=dtype)
    views = [view for name, param, spec in named_shards(model)
             for view in whole_param_views(name, spec, param, None, True)]
    load_views(ckpt.path, views, kinds=("param",))
    return model.eval()
