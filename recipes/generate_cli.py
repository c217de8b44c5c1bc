"""`megazoo generate CKPT --prompt TEXT --max-new-tokens N [--temperature T] [--top-k K] [--top-p P] [--seed S]
[--tp N] [--tokenizer TOK]`: continue a prompt with a trained model; the continuation goes to stdout.

CKPT is a run's `checkpoints/` folder (its latest good checkpoint) or one `step_N` directory; the tokenizer is
the one the checkpoint records (models/loading.py), or --tokenizer. Decoding (models/generation/generate.py) uses a KV
cache and stops early at the tokenizer's end-of-text id. Everything is checked in this process before any
worker starts (exit 2 and one line naming the value); with --tp N > 1 the command relaunches itself under
torchrun (`python -m megazoo.recipes.generate_cli`), every rank loads only its own shards and decodes in step,
and rank 0 prints.
"""

from __future__ import annotations

import argparse
import sys

from megazoo.workers.tp_command import run_here_or_relaunch, verify_before_workers



def _check(args: argparse.Namespace):
    from megazoo.models.generation.generate import check_sampling
    from megazoo.models.loading import open_checkpoint

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} is invalid: use 0 or more")
    check_sampling(args.temperature, args.top_k, args.top_p)
    from megazoo.workers.tp_command import say

    ckpt = open_checkpoint(args.checkpoint, args.tokenizer, report=say)
    if args.tp < 1 or ckpt.cfg.n_head % args.tp:
        raise ValueError(f"--tp {args.tp} must be a positive divisor of the model's n_head = {ckpt.cfg.n_head}")
    if not ckpt.tokenizer.encode(args.prompt):
        raise ValueError("--prompt encodes to no tokens: give some text")
    return ckpt


def continuation(args: argparse.Namespace, topo) -> str:
    """Decode on this rank (collective under tp) and return the new text."""
    from megazoo.models.generation.generate import decode
    from megazoo.models.loading import load_gpt

    ckpt = _check(args)
    tokenizer = ckpt.tokenizer
    model = load_gpt(ckpt, topo)
    prompt = tokenizer.encode(args.prompt)
    eos = tokenizer.eod_id
    ids = decode(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, seed=args.seed, stop=lambda new: new[-1] == eos)
    new = ids[len(prompt):]
    if new and new[-1] == eos:  # the end-of-text mark ends the text; it is not part of it
        new = new[:-1]
    return tokenizer.decode(new)


def _forwarded_argv(args: argparse.Namespace) -> list[str]:
    argv = [str(args.checkpoint), "--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens),
            "--temperature", repr(args.temperature), "--top-k", str(args.top_k), "--top-p", repr(args.top_p),
            "--seed", str(args.seed), "--tp", str(args.tp)]
    return argv + (["--tokenizer", str(args.tokenizer)] if args.tokenizer else [])


def _pin_checkpoint(args: argparse.Namespace) -> None:
    """Check the input here; every worker then decodes the checkpoint resolved (and, under tp, verified) here."""
    step_dir = _check(args).path
    verify_before_workers(args, step_dir)
    args.checkpoint = str(step_dir)


def _decode_and_print(args: argparse.Namespace, topo) -> None:
    text = continuation(args, topo)
    if topo.tp_rank == 0:
        print(text, flush=True)


def _run(args: argparse.Namespace) -> int:
    return run_here_or_relaunch(args, "megazoo.recipes.generate_cli", _pin_checkpoint, _forwarded_argv,
                                _decode_and_print)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="a run's checkpoints/ folder (its latest good checkpoint) or one step_N directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, required=True, metavar="N",
                        help="at most N new tokens (fewer when the model ends the text)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample from the smallest set holding probability P (1: off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (torchrun; default 1)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer spec (default: the one the checkpoint records)")


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="continue a prompt with a checkpoint's model (KV cache)")
    add_arguments(parser)
    parser.set_defaults(func=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """torchrun worker entry point: every rank decodes, rank 0 prints."""
    from megazoo.workers.local import tp_worker

    parser = argparse.ArgumentParser(prog="megazoo generate")
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    return tp_worker(args, _run, _decode_and_print)


if __name__ == "__main__":
    sys.exit(main())
