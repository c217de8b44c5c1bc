"""`megazoo eval harness --checkpoint CKPT --tasks T1,T2 [--tokenizer TOK] [--tp N] [--batch-size B]
[--include-path DIR] [--limit N] [--bootstrap-iters N] [--json OUT]`: lm-eval's evaluator on a megazoo checkpoint.

The model is eval/harness_model.py's lm-eval model class. Checked in this process before any worker starts (exit
2 and one line): lm-eval installed (else the line names the `megazoo[eval]` extra), the checkpoint and its
tokenizer (recorded in the checkpoint, or --tokenizer), --tp against the heads, and the task names (an unknown
one gets lm-eval's own "Tasks not found" message). Tasks are looked up in --include-path first, and lm-eval's
~14,000 built-in task configs are indexed only when a name is not found there.

With --tp N > 1 the command relaunches itself under torchrun (`python -m megazoo.eval.harness`): every rank loads
only its own shards of the checkpoint (no consolidated copy) and runs every forward; rank 0 drives lm-eval, prints
lm-eval's table and writes lm-eval's `results` object (--json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megazoo.workers.tp_command import EP_HELP, check_ep, run_here_or_relaunch, verify_before_workers


EXTRA_HINT = "megazoo eval harness needs lm-eval: pip install 'megazoo[eval]' (or pip install lm-eval)"


def task_manager(include_path: str | None, tasks: list[str]):
    """lm-eval's TaskManager that knows every task in `tasks`; raises lm-eval's message for unknown ones."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if len(local.match_tasks(tasks)) == len(tasks):
            return local
    manager = TaskManager(include_path=include_path)
    found = manager.match_tasks(tasks)
    missing = [task for task in tasks if task not in found]
    if missing:
        raise ValueError(f"Tasks not found: {', '.join(missing)}")
    return manager


def check(args: argparse.Namespace, with_tasks: bool = True):
    """Everything but the weights; returns (opened checkpoint, task names, TaskManager or None)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(EXTRA_HINT) from None
    from megazoo.models.loading import open_checkpoint

    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    if not tasks:
        raise ValueError(f"--tasks {args.tasks!r} names no task: give T1,T2,...")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} is invalid: it must be a positive integer")
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit == int(args.limit))):
        raise ValueError(f"--limit {args.limit:g} is invalid: a whole number of documents (>= 1) or a fraction of "
                         "each task (0 < limit < 1), as lm-eval takes it")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot} is invalid: use 0 or more")
    if args.log_samples and not args.output_path:
        raise ValueError("--log-samples needs --output-path DIR (where the samples are written), as lm-eval's")
    if args.output_path and Path(args.output_path).exists() and any(Path(args.output_path).iterdir()):
        raise ValueError(f"--output-path {args.output_path} holds files already: give a new or empty folder "
                              "(nothing is overwritten)")
    _gen_kwargs(args.gen_kwargs)  # a malformed one fails here, before any weights are read
    if args.bootstrap_iters < 0:
        raise ValueError(f"--bootstrap-iters {args.bootstrap_iters} is invalid: use 0 (no stderr) or more")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise FileNotFoundError(f"--include-path {args.include_path}: directory not found")
    from megazoo.workers.tp_command import say

    opened = open_checkpoint(args.checkpoint, args.tokenizer, report=say, need_base=True,
                             lora_base=args.lora_base)  # a LoRA run's: its adapters on the base it recorded
    if args.tp < 1 or opened.cfg.n_head % args.tp:
        raise ValueError(f"--tp {args.tp} must be a positive divisor of the model's n_head = {opened.cfg.n_head}")
    check_ep(args.ep, opened.cfg)
    return opened, tasks, task_manager(args.include_path, tasks) if with_tasks else None


def run(args: argparse.Namespace, topo) -> dict | None:
    """Evaluate on this rank: rank 0 drives lm-eval and returns its output; the other ranks serve forwards."""
    from megazoo.eval.harness_model import MegazooLM, TPForward, serve
    from megazoo.models.loading import load_gpt

    opened, tasks, manager = check(args, with_tasks=topo.rank == 0)  # only rank 0 talks to lm-eval
    model = load_gpt(opened, topo)
    if topo.rank != 0:
        serve(model)
        return None
    import lm_eval
    from lm_eval.utils import make_table

    forward = TPForward(model) if topo.world_size > 1 else None  # tp and / or ep: every rank runs each forward
    try:
        lm = MegazooLM.from_parts(model, opened.tokenizer, forward, batch_size=args.batch_size)
        seeds = {} if args.seed is None else dict(random_seed=args.seed, numpy_random_seed=args.seed,
                                                   torch_random_seed=args.seed, fewshot_random_seed=args.seed)
        limit = None if args.limit is None else (args.limit if args.limit < 1 else int(args.limit))
        output = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager,
                                         bootstrap_iters=args.bootstrap_iters, num_fewshot=args.num_fewshot,
                                         gen_kwargs=_gen_kwargs(args.gen_kwargs), log_samples=args.log_samples,
                                         **seeds)
    finally:
        if forward is not None:
            forward.close()
    print(make_table(output), flush=True)
    if args.json:
        from megazoo.eval.scoring import write_result_json

        write_result_json(output["results"], args.json)
    if args.output_path:
        _write_output(output, Path(args.output_path), args.log_samples)
    return output


def _gen_kwargs(text: str | None) -> dict | None:
    """--gen-kwargs "temperature=0,max_gen_toks=32" (lm-eval's form) as a dict; ValueError naming a bad part."""
    if not text:
        return None
    parsed = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--gen-kwargs {text!r}: {part!r} is not KEY=VALUE (e.g. temperature=0,max_gen_toks=32)")
        value = value.strip()
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        parsed[key.strip()] = {"True": True, "False": False}.get(value, value) if isinstance(value, str) else value
    return parsed


def _write_output(output: dict, folder: Path, samples: bool) -> None:
    """--output-path: results.json (lm-eval's results, configs and versions) and, with --log-samples, one
    samples_TASK.jsonl per task (every document's request, response and metrics), written atomically."""
    import json

    from megazoo.data.fileio import atomic_write_text

    folder.mkdir(parents=True, exist_ok=True)
    record = {key: output[key] for key in ("results", "configs", "versions", "n-shot") if key in output}
    atomic_write_text(folder / "results.json", json.dumps(record, indent=2, default=str) + "\n")
    for task, rows in (output.get("samples") or {}).items() if samples else ():
        atomic_write_text(folder / f"samples_{task}.jsonl",
                          "".join(json.dumps(row, default=str) + "\n" for row in rows))


def _forwarded_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--checkpoint", str(args.checkpoint), "--tasks", args.tasks, "--tp", str(args.tp), "--ep", str(args.ep),
            "--batch-size", str(args.batch_size), "--bootstrap-iters", str(args.bootstrap_iters)]
    for flag, value in (("--tokenizer", args.tokenizer), ("--include-path", args.include_path),
                        ("--limit", args.limit), ("--json", args.json), ("--num-fewshot", args.num_fewshot),
                        ("--gen-kwargs", args.gen_kwargs), ("--seed", args.seed), ("--output-path", args.output_path),
                        ("--lora-base", args.lora_base)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--log-samples"] if args.log_samples else [])


def _pin_checkpoint(args: argparse.Namespace) -> None:
    """Check everything but the weights here; every worker then reads the checkpoint resolved here."""
    opened, _, _ = check(args)
    verify_before_workers(args, opened.path)
    args.checkpoint = str(opened.path)
    if opened.base is not None:  # a LoRA run's base: every worker reads the one resolved here
        verify_before_workers(args, opened.base)
        args.lora_base = str(opened.base)


def _run(args: argparse.Namespace) -> int:
    return run_here_or_relaunch(args, "megazoo.eval.harness", _pin_checkpoint, _forwarded_argv, run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="CKPT",
                        help="a run's checkpoints/ folder (its latest good checkpoint) or one step_N directory")
    parser.add_argument("--tasks", required=True, metavar="T1,T2", help="lm-eval task names, comma-separated")
    parser.add_argument("--lora-base", default=None, metavar="CKPT", help="--checkpoint of a LoRA run: its base "
                        "checkpoint (default: the checkpoint.load that run recorded)")
    parser.add_argument("--tokenizer", default=None, metavar="TOK",
                        help="tokenizer spec (default: the one the checkpoint records)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (torchrun; default 1)")
    parser.add_argument("--ep", type=int, default=1, help=EP_HELP)
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward (default 8)")
    parser.add_argument("--include-path", default=None, metavar="DIR", help="more lm-eval task yamls (first)")
    parser.add_argument("--limit", type=float, default=None, metavar="N",
                        help="the first N documents per task, or a fraction of each task when 0 < N < 1")
    parser.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                        help="few-shot examples per prompt (default: each task's own)")
    parser.add_argument("--gen-kwargs", default=None, metavar="K=V,...",
                        help="generation arguments for generate_until tasks, e.g. temperature=0,max_gen_toks=32")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="one seed for lm-eval's python, numpy, torch and few-shot draws (default: lm-eval's)")
    parser.add_argument("--output-path", default=None, metavar="DIR",
                        help="write results.json here (a new or empty folder), and with --log-samples every sample")
    parser.add_argument("--log-samples", action="store_true",
                        help="with --output-path: samples_TASK.jsonl, each document's request, response, metrics")
    parser.add_argument("--bootstrap-iters", type=int, default=100000, metavar="N",
                        help="lm-eval's bootstrap iterations for standard errors (default 100000; 0: none)")
    parser.add_argument("--json", default=None, metavar="OUT.json", help="write lm-eval's results object here")


def register(tasks_subparsers) -> argparse.ArgumentParser:
    """`megazoo eval harness` (added to eval's task subparsers by eval/cli.py)."""
    parser = tasks_subparsers.add_parser("harness", help="lm-eval's tasks on a megazoo checkpoint (any tp)")
    add_arguments(parser)
    parser.set_defaults(func=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """torchrun worker entry point: reads the launcher's RANK / WORLD_SIZE."""
    from megazoo.workers.local import tp_worker

    parser = argparse.ArgumentParser(prog="megazoo eval harness")
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return tp_worker(args, _run, run)


if __name__ == "__main__":
    sys.exit(main())
