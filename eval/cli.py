"""`megazoo eval wikitext103|lambada (--checkpoint DIR | --hf DIR) --data FILE [options]`.

The model comes from a consolidated megazoo checkpoint (`megazoo convert`) or a Hugging Face GPT-2 directory,
and runs through our GPT (at tensor-parallel size --tp, every rank scoring the same batches) or, for --hf with
--backend transformers, through transformers' GPT2LMHeadModel itself, for cross-checks. Every input is checked
before any process starts; bad input ends with one line naming the file and exit code 2. Rank 0 shows a
progress bar, prints a one-line summary and writes the JSON result (--json).

With --tp N > 1 the command relaunches itself under torchrun (`python -m torch.distributed.run -m megazoo.eval.cli`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

TASKS = ("wikitext103", "lambada")


@dataclass(frozen=True)
class ModelSource:
    cfg: object  # models.config.ModelConfig
    name: str
    tokenizer: object  # a data.tokenizer.Tokenizer
    checkpoint: Path | None = None  # --checkpoint: the step directory it resolved to (recorded in the JSON)
    step: int | None = None  # that checkpoint's training step


def check_inputs(args: argparse.Namespace) -> ModelSource:
    """Validate model config, tokenizer and data path before any process is started or weights are read."""
    from megazoo.data.tokenizer_loading import load_tokenizer
    from megazoo.models.gpt2.convert_cli import load_consolidated_config
    from megazoo.parallel.checkpoint.consolidate import read_common, resolve_checkpoint

    checkpoint = step = None
    if args.hf is not None:
        from megazoo.models.gpt2.hf import read_hf_config

        model_dir = Path(args.hf)
        cfg = read_hf_config(model_dir)
    else:
        model_dir = Path(args.checkpoint)
        checkpoint = resolve_checkpoint(model_dir).resolve()  # a checkpoints folder: its latest good one, once
        cfg = load_consolidated_config(checkpoint)
        step = read_common(checkpoint)["step"]
    stride = getattr(args, "stride", None)
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
    tokenizer_dir = args.tokenizer if args.tokenizer else model_dir
    try:
        tokenizer = load_tokenizer(tokenizer_dir)  # GPT-2 BPE dir, tokenizer.json, sentencepiece .model, hf:NAME
    except FileNotFoundError as error:
        hint = "" if args.tokenizer else " (pass --tokenizer DIR with the GPT-2 BPE files)"
        raise FileNotFoundError(f"{error}{hint}") from error
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"the model's vocabulary ({cfg.vocab_size} ids, {model_dir}) does not match the tokenizer "
                         f"in {tokenizer_dir} ({tokenizer.vocab_size} ids): pass the model's own --tokenizer")
    if not Path(args.data).is_file():
        raise FileNotFoundError(f"--data {args.data}: file not found")
    check_data(args.task, args.data)
    return ModelSource(cfg, cfg.name, tokenizer, checkpoint, step)


def check_data(task: str, path: str | Path) -> None:
    """Read and parse the data file (no tokenizing): malformed data fails before any process starts."""
    from megazoo.eval.lambada import read_lambada_texts
    from megazoo.eval.scoring import read_text_file

    if task == "lambada":
        read_lambada_texts(path)
    elif len(read_text_file(path, "WikiText").strip().split(" ")) < 2:
        raise ValueError(f"WikiText file {path} has too little text to evaluate")


def _logits_fn(args: argparse.Namespace, source: ModelSource, topo):
    from megazoo.eval.scoring import gpt_logits_fn, hf_logits_fn
    from megazoo.models.gpt2.convert_cli import load_consolidated
    from megazoo.models.gpt2.hf import gpt_from_full_state, read_hf_dir

    if args.backend == "transformers":
        from transformers import GPT2LMHeadModel

        return hf_logits_fn(GPT2LMHeadModel.from_pretrained(args.hf).to(topo.device))
    cfg, full_state = read_hf_dir(args.hf) if args.hf is not None else load_consolidated(source.checkpoint)
    return gpt_logits_fn(gpt_from_full_state(cfg, full_state, topo))


def evaluate(args: argparse.Namespace, topo) -> dict:
    """Run the evaluation on this rank; rank 0 prints the summary and writes the JSON. Returns the result."""
    from megazoo.eval import lambada, wikitext103

    source = check_inputs(args)
    tokenizer = source.tokenizer
    lead = topo.rank == 0
    common = dict(context=source.cfg.n_positions, pad_id=tokenizer.eod_id, batch_size=args.batch_size,
                  limit=args.limit, progress=lead, model_name=source.name)
    if args.task == "wikitext103":
        data = wikitext103.load_wikitext(args.data, tokenizer)
        result = wikitext103.evaluate_wikitext(_logits_fn(args, source, topo), data, stride=args.stride,
                                               **common)
        line = wikitext103.summary_line(result)
    else:
        data = lambada.load_lambada(args.data, tokenizer)
        result = lambada.evaluate_lambada(_logits_fn(args, source, topo), data, **common)
        line = lambada.summary_line(result)
    result.update(backend=args.backend, tp=topo.tp, limit=args.limit)
    if source.checkpoint is not None:  # which checkpoint was evaluated, exactly
        result.update(checkpoint=str(source.checkpoint), checkpoint_step=source.step)
    if lead:
        print(line, flush=True)
        if args.json:
            from megazoo.eval.scoring import write_result_json

            write_result_json(result, args.json)
    return result


def _forwarded_argv(args: argparse.Namespace) -> list[str]:
    """The eval command line again, for the torchrun workers."""
    argv = [args.task, "--hf" if args.hf is not None else "--checkpoint", str(args.hf or args.checkpoint),
            "--data", str(args.data), "--batch-size", str(args.batch_size), "--backend", args.backend,
            "--tp", str(args.tp)]
    for flag, value in (("--tokenizer", args.tokenizer), ("--json", args.json), ("--limit", args.limit),
                        ("--stride", getattr(args, "stride", None))):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _run_eval(args: argparse.Namespace) -> int:
    from megazoo.parallel.launcher import launch_local
    from megazoo.parallel.topology import Topology

    try:
        if args.tp > 1:
            source = check_inputs(args)  # in this process: bad input fails before any worker starts
            if source.checkpoint is not None:  # every worker evaluates the checkpoint resolved here
                args.checkpoint = str(source.checkpoint)
            return launch_local(args.tp, "megazoo.eval.cli", _forwarded_argv(args))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        evaluate(args, Topology.solo(device))
    except (FileNotFoundError, ValueError) as error:
        print(f"megazoo: error: {error}", file=sys.stderr)
        return 2
    return 0


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint", metavar="DIR", help="consolidated megazoo checkpoint (megazoo convert)")
    model.add_argument("--hf", metavar="DIR", help="Hugging Face GPT-2 directory (config.json + weights)")
    parser.add_argument("--data", required=True, metavar="FILE", help="the evaluation data file")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="GPT-2 BPE directory (vocab.json + merges.txt or encoder.json + vocab.bpe); "
                             "default: the model directory")
    parser.add_argument("--json", metavar="OUT.json", default=None, help="write the result record here")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="score only the first N windows / examples (quick checks)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows / examples per forward (default 4)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (torchrun; default 1)")
    parser.add_argument("--backend", choices=("megazoo", "transformers"), default="megazoo",
                        help="run the model through megazoo's GPT (default) or transformers (--hf only)")


def register(subparsers) -> argparse.ArgumentParser:
    """Add `eval` (with `wikitext103` and `lambada`) to the `megazoo` command's subparsers."""
    parser = subparsers.add_parser("eval", help="zero-shot WikiText-103 perplexity / LAMBADA accuracy")
    tasks = parser.add_subparsers(dest="task", required=True)
    wiki = tasks.add_parser("wikitext103", help="perplexity with overlapping windows (Megatron-LM's protocol)")
    _add_common_arguments(wiki)
    wiki.add_argument("--stride", type=int, default=32,
                      help="window stride s: each window after the first scores its last s tokens (default 32)")
    lamb = tasks.add_parser("lambada", help="strict last-word accuracy on LAMBADA (OpenAI's jsonl)")
    _add_common_arguments(lamb)
    for task_parser in (wiki, lamb):
        task_parser.set_defaults(func=_run_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    """torchrun worker entry point (`python -m megazoo.eval.cli TASK ...`): reads the launcher's RANK/WORLD_SIZE."""
    from megazoo.parallel.local_launch import finish_worker
    from megazoo.parallel.topology import Topology, init_distributed

    parser = argparse.ArgumentParser(prog="megazoo eval")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world_size == 1:
        args.tp = 1
        return args.func(args)
    init_distributed(rank, world_size, init_method="env://")
    code = 0
    try:
        evaluate(args, Topology.build(dp=1, tp=world_size))
    except (FileNotFoundError, ValueError) as error:
        print(f"megazoo: error (rank {rank}): {error}", file=sys.stderr)
        code = 2
    finish_worker(code)  # barrier (when all went well), destroy the group, flush, os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
