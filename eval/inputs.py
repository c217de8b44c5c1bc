"""What `megazoo eval wikitext103|lambada` checks before any process starts or any weight is read.

The model config, its tokenizer (--tokenizer, else the one the checkpoint records or the --hf directory's own
files), the flags against the model, and the data file: parsed (no tokenizing) and recognised, so that a LAMBADA
jsonl given to the WikiText task, or a WikiText text file given to LAMBADA, is refused with the reason.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

PROTOCOLS = ("megatron", "lm-eval")
DEFAULT_STRIDE = 32


@dataclass(frozen=True)
class ModelSource:
    cfg: object  # models.config.ModelConfig
    name: str
    tokenizer: object  # a data.tokenizer.Tokenizer
    checkpoint: Path | None = None  # --checkpoint: the step directory it resolved to (recorded in the JSON)
    step: int | None = None  # that checkpoint's training step
    skipped: tuple[str, ...] = ()  # newer checkpoints that did not verify (recorded in the JSON)
    lora_base: Path | None = None  # a LoRA run's checkpoint: the base its adapters sit on (recorded in the JSON)


def check_inputs(args: argparse.Namespace) -> ModelSource:
    """Validate model config, tokenizer and data path before any process is started or weights are read."""
    from megazoo.data.tokenizers.loading import load_tokenizer

    protocol = getattr(args, "protocol", "megatron")
    if protocol not in PROTOCOLS:
        raise ValueError(f"--protocol {protocol!r} is invalid: use one of {', '.join(PROTOCOLS)}")
    checkpoint = step = lora_base = None
    skipped: tuple[str, ...] = ()
    if args.hf is not None:
        from megazoo.models.hf.families import read_hf_config, tokenizer_spec  # every family convert reads

        model_dir = Path(args.hf)
        cfg = read_hf_config(model_dir)[1]
        tokenizer_dir = args.tokenizer if args.tokenizer else tokenizer_spec(model_dir)
        try:
            tokenizer = load_tokenizer(tokenizer_dir)  # GPT-2 BPE dir, tokenizer.json, sentencepiece .model, hf:NAME
        except FileNotFoundError as error:
            hint = "" if args.tokenizer else " (pass --tokenizer DIR with the GPT-2 BPE files)"
            raise FileNotFoundError(f"{error}{hint}") from error
    else:
        from megazoo.models.loading import open_checkpoint

        from megazoo.workers.tp_command import say

        opened = open_checkpoint(args.checkpoint, args.tokenizer, report=say, need_base=True,
                                 lora_base=getattr(args, "lora_base", None))
        model_dir, tokenizer_dir = opened.path, args.tokenizer or f"recorded in {opened.path}"
        cfg, tokenizer, checkpoint, step = opened.cfg, opened.tokenizer, opened.path, opened.step
        skipped, lora_base = opened.skipped, opened.base
    stride = getattr(args, "stride", None)
    if stride is not None and protocol == "lm-eval":
        raise ValueError(f"--stride {stride} applies to --protocol megatron only: lm-eval's WikiText protocol scores "
                         "disjoint windows of the model's full context")
    if stride is not None and not 1 <= stride <= cfg.n_positions:
        raise ValueError(f"--stride {stride} must be between 1 and the model's context {cfg.n_positions}")
    for flag, value in (("--limit", args.limit), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} is invalid: it must be a positive integer")
    if args.backend == "transformers" and args.hf is None:
        raise ValueError("--backend transformers needs --hf DIR (a megazoo checkpoint runs through megazoo)")
    if args.backend == "transformers" and args.tp > 1:
        raise ValueError("--backend transformers runs in one process: use --tp 1")
    if args.tp < 1 or cfg.n_head % args.tp:
        raise ValueError(f"--tp {args.tp} must be a positive divisor of the model's n_head = {cfg.n_head}")
    from megazoo.workers.tp_command import check_ep

    check_ep(getattr(args, "ep", 1), cfg)
    if args.backend == "transformers" and getattr(args, "ep", 1) > 1:
        raise ValueError(f"--backend transformers runs in one process: use --ep 1 (not {args.ep})")
    if tokenizer.vocab_size > cfg.vocab_size:  # a model may hold more ids than its tokenizer (padded, e.g. Qwen2)
        raise ValueError(f"the model's vocabulary ({cfg.vocab_size} ids, {model_dir}) does not match the tokenizer "
                         f"{tokenizer_dir} ({tokenizer.vocab_size} ids): pass the model's own --tokenizer")
    if not Path(args.data).is_file():
        raise FileNotFoundError(f"--data {args.data}: file not found")
    check_data(args.task, args.data)
    if args.hf is not None and getattr(args, "lora_base", None):
        raise ValueError("--lora-base applies to --checkpoint of a LoRA run, not to --hf")
    return ModelSource(cfg, cfg.name, tokenizer, checkpoint, step, skipped, lora_base)


def _first_line_is_json_object(text: str) -> bool:
    first = next((line for line in text.splitlines() if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def check_data(task: str, path: str | Path) -> None:
    """Read and parse the data file (no tokenizing): malformed or mismatched data fails before any process."""
    from megazoo.eval.lambada import read_lambada_texts
    from megazoo.eval.scoring import read_text_file

    text = read_text_file(path, "LAMBADA" if task == "lambada" else "WikiText")
    if task == "lambada":
        if not _first_line_is_json_object(text):
            raise ValueError(f"LAMBADA file {path} is not JSON lines (its first line is not a JSON object): it looks "
                             "like plain text, e.g. a WikiText file (use `megazoo eval wikitext103` for those); "
                             "LAMBADA needs OpenAI's lambada_test.jsonl")
        read_lambada_texts(path)
        return
    if _first_line_is_json_object(text):
        raise ValueError(f"WikiText file {path} is JSON lines (its first line is a JSON object), e.g. LAMBADA's "
                         "jsonl (use `megazoo eval lambada` for those); WikiText needs the plain-text "
                         "wiki.test.tokens (or wiki.test.raw)")
    if len(text.strip().split(" ")) < 2:
        raise ValueError(f"WikiText file {path} has too little text to evaluate")
