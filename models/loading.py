"""A checkpoint as a ready model: its step directory, config and tokenizer, and this rank's shards of its weights.

`open_checkpoint(path, tokenizer=None)` resolves a run's `checkpoints/` folder (its latest good checkpoint) or one
`step_N` directory and reads what the checkpoint knows without touching the weights: the model config, the step
and the tokenizer (an explicit `tokenizer` spec wins; else the one the checkpoint records, data/tokenizers/store.py).
`load_gpt(ckpt, topology)` builds a whole (pp = 1) GPT for this rank and fills its tensor-parallel shards straight
from the sharded files (parallel/checkpoint/load.py assembles one parameter at a time and keeps this rank's
shard), so a tp > 1 job never holds the consolidated model on one rank.

A LoRA run's checkpoint holds only the adapters: opened with `need_base=True` it resolves the base they sit on
(`lora_base`, else the run's recorded checkpoint.load: models/lora/checkpoint.py), and `load_gpt` builds the model
as the run trained it, the adapters attached to the frozen base, each read from its own checkpoint (no export with
--merge-lora first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from megazoo.data.tokenizers.tokenizer import Tokenizer
from megazoo.models.config import ModelConfig, architecture_mismatches
from megazoo.models.lora.checkpoint import lora_base, lora_of_common
from megazoo.models.lora.config import LoRAConfig
from megazoo.models.transformer import GPT
from megazoo.parallel.checkpoint.consolidate import resolve_checkpoint
from megazoo.parallel.checkpoint.io import CheckpointError, read_common, verify_checkpoint
from megazoo.parallel.checkpoint.load import load_views
from megazoo.parallel.checkpoint.views import StateView, whole_param_views
from megazoo.parallel.tensor import ShardSpec, named_shards, unique_named_shards
from megazoo.parallel.tensor.lora import is_lora_parameter
from megazoo.parallel.topology import Topology


@dataclass(frozen=True)
class OpenCheckpoint:
    path: Path  # the step directory
    step: int
    cfg: ModelConfig
    tokenizer: Tokenizer | None  # None: neither given nor recorded
    skipped: tuple[str, ...] = ()  # newer checkpoints that did not verify, each with the reason
    lora: LoRAConfig | None = None  # a LoRA run's checkpoint: the adapters' settings (it holds only the adapters)
    base: Path | None = None  # then the base step directory they sit on (opened with need_base=True)


def model_config(common: dict, path: Path) -> ModelConfig:
    try:
        return ModelConfig(**common["model"])
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path}: model config is corrupt: {error!r}") from error


def open_checkpoint(path: str | Path, tokenizer: str | Path | None = None, *, need_tokenizer: bool = True,
                    report=print, verify: bool = False, need_base: bool = False,
                    lora_base: str | Path | None = None) -> OpenCheckpoint:
    """Resolve `path`, read its config and tokenizer; refuse a tokenizer whose vocabulary the model lacks.

    A run's checkpoints folder resolves to its newest checkpoint that verifies; when a newer one is damaged, that
    is never silent: `report` hears each one skipped and which checkpoint is used, and `skipped` records them.
    `verify`: also check every file of a step directory named directly (sizes and sha256). `need_base`: a LoRA
    run's checkpoint also resolves its base (`lora_base`, else the recorded one) and checks it holds the model."""
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
    lora = lora_of_common(common)
    base = _base_of(common, step_dir, cfg, lora_base, report) if lora is not None and need_base else None
    return OpenCheckpoint(step_dir, common["step"], cfg, tok, tuple(problems), lora, base)


def _base_of(common: dict, step_dir: Path, cfg: ModelConfig, given, report) -> Path:
    """The base step directory of a LoRA checkpoint, checked to hold the adapters' model."""
    base = resolve_checkpoint(lora_base(common, step_dir, given), report=report).resolve()
    mismatches = architecture_mismatches(read_common(base)["model"], dataclasses.asdict(cfg))
    if mismatches:
        raise CheckpointError(f"LoRA base {base} holds a different model than the adapters of {step_dir}: "
                              f"{'; '.join(mismatches)} (--lora-base names another)")
    return base


def load_gpt(ckpt: OpenCheckpoint, topology: Topology, dtype: torch.dtype = torch.float32) -> GPT:
    """This rank's whole (pp = 1) GPT at `topology`'s tp, its shards read from the checkpoint, in eval mode.
    A LoRA checkpoint's model carries its adapters (dropout off in eval mode): the base weights come from
    `ckpt.base`, the adapters from the checkpoint, so it computes what the run's own forward computed."""
    model = GPT(ckpt.cfg, topology, device=topology.device, dtype=dtype)
    if ckpt.lora is not None:
        if ckpt.base is None:
            raise ValueError(f"checkpoint {ckpt.path} holds LoRA adapters only: open it with need_base=True")
        from megazoo.models.lora.adapters import attach_lora

        attach_lora(model, ckpt.lora)
    views = [view for name, param, spec in named_shards(model)
             for view in whole_param_views(name, spec, param, None, True)]
    if ckpt.lora is None:
        load_views(ckpt.path, views, kinds=("param",))
    else:
        load_views(ckpt.base, [v for v in views if not is_lora_parameter(v.name)], kinds=("param",))
        load_views(ckpt.path, [v for v in views if is_lora_parameter(v.name)], kinds=("param",))
    return model.eval()


def load_gpt_from_hf(hf_dir: str | Path, topology: Topology, dtype: torch.dtype = torch.float32, weights=None) -> GPT:
    """This rank's whole (pp = 1) GPT of a Hugging Face folder of any family, in eval mode: its tp shards and its
    ep experts (and DeepSeek-V3's routing bias) read straight from the files by `model.from_hf`'s reader
    (models/hf/converter.fill_views_from_hf), so no rank reads another's experts or holds the whole state.
    `weights`: the folder's HFWeights (a caller counting what is read); else opened here."""
    from megazoo.models.hf.converter import check_copies, fill_views_from_hf
    from megazoo.models.hf.families import read_hf_config
    from megazoo.models.hf.safetensors_files import HFWeights

    family, cfg, _ = read_hf_config(hf_dir)
    model = GPT(cfg, topology, device=topology.device, dtype=dtype)
    unique, _ = unique_named_shards(model)  # a tied head: filled through the embedding's name
    views = [view for name, param, spec in unique for view in whole_param_views(name, spec, param, None, False)]
    views += [StateView(name, ShardSpec(tuple(buf.shape)), "param", 0, buf.numel(), buf.view(-1), False)
              for name, buf in model.named_buffers() if name.endswith("router.expert_bias")]
    weights = weights if weights is not None else HFWeights(hf_dir)
    check_copies(weights, family, cfg)  # as the whole-state load refused them (a differing tied head, MTP copies)
    fill_views_from_hf(weights, family, cfg, views, kinds=("param",))
    return model.eval()
