"""`megazoo eval wikitext103|lambada (--checkpoint DIR | --hf DIR) --data FILE [--protocol megatron|lm-eval] ...`
and `megazoo eval harness ...` (lm-eval's own tasks, eval/harness.py).

The model comes from a megazoo checkpoint of any layout (a training run's checkpoints/ folder, one step_N
directory, or `megazoo convert`'s output) or a Hugging Face directory of any family `megazoo convert` reads
(GPT-2, Llama, Qwen2, Mistral: models/hf/families.py), and runs through our GPT (at tensor-parallel size --tp,
every rank scoring the same batches, each holding only its own shards) or, for --hf with --backend transformers,
through the family's own transformers model (e.g. LlamaForCausalLM), for cross-checks. The tokenizer is
--tokenizer, else the one the checkpoint records. --protocol megatron (default) is Megatron-LM's evaluation,
the published rows' protocol (eval/wikitext103.py, eval/lambada.py); lm-eval is lm-evaluation-harness's
(eval/lm_eval_protocol.py). Every input is checked before any process starts (eval/inputs.py); bad input ends
with one line naming the file and exit code 2. Rank 0 shows a progress bar, prints a one-line summary and writes
the JSON result (--json), which records the protocol.

With --tp N > 1 the command relaunches itself under torchrun (`python -m torch.distributed.run -m megazoo.eval.cli`);
with --ep E > 1 (an MoE model) on E x N workers, the routed experts split over E ranks (each reads only its own
experts from the checkpoint), each batch's rows split over them too (eval/scoring.gpt_forward: the tokens reach
their experts by all-to-all, the logits are all-gathered), so every rank scores every batch with 1/E of the work.
"""

from __future__ import annotations

import argparse
import sys


from megazoo.eval.harness import register as register_harness
from megazoo.eval.inputs import DEFAULT_STRIDE, PROTOCOLS, ModelSource, check_inputs
from megazoo.workers.tp_command import EP_HELP, run_here_or_relaunch, verify_before_workers

TASKS = ("wikitext103", "lambada")


def _logits_fn(args: argparse.Namespace, source: ModelSource, topo):
    from megazoo.eval.scoring import gpt_logits_fn, hf_logits_fn
    from megazoo.models.hf.families import load_hf_causal_lm
    from megazoo.models.loading import load_gpt, load_gpt_from_hf, open_checkpoint

    if args.backend == "transformers":  # the family's own *ForCausalLM (models/hf/families.py)
        return hf_logits_fn(load_hf_causal_lm(args.hf, topo.device))
    # Each rank reads only its own shards of each parameter (its tp slices, its ep experts; no consolidated copy of
    # the model), from the HF folder's files or the checkpoint's.
    if args.hf is not None:
        return gpt_logits_fn(load_gpt_from_hf(args.hf, topo))
    # A LoRA run's checkpoint: its adapters on the base it recorded (or --lora-base), as the run computed.
    opened = open_checkpoint(source.checkpoint, need_tokenizer=False, need_base=True,
                             lora_base=getattr(args, "lora_base", None))
    return gpt_logits_fn(load_gpt(opened, topo))


def evaluate(args: argparse.Namespace, topo) -> dict:
    """Run the evaluation on this rank; rank 0 prints the summary and writes the JSON. Returns the result."""
    from megazoo.eval import lambada, lm_eval_protocol, wikitext103

    source = check_inputs(args)
    tokenizer = source.tokenizer
    lead = topo.rank == 0
    protocol = getattr(args, "protocol", "megatron")
    common = dict(context=source.cfg.n_positions, pad_id=tokenizer.eod_id, batch_size=args.batch_size,
                  limit=args.limit, progress=lead, model_name=source.name)
    if protocol == "lm-eval":  # lm-eval's lambada_openai / wikitext (eval/lm_eval_protocol.py)
        run = lm_eval_protocol.evaluate_lambada if args.task == "lambada" else lm_eval_protocol.evaluate_wikitext
        result = run(_logits_fn(args, source, topo), args.data, tokenizer, **common)
        line = lm_eval_protocol.summary_line(result)
    elif args.task == "wikitext103":
        data = wikitext103.load_wikitext(args.data, tokenizer)
        stride = DEFAULT_STRIDE if getattr(args, "stride", None) is None else args.stride
        result = wikitext103.evaluate_wikitext(_logits_fn(args, source, topo), data, stride=stride, **common)
        line = wikitext103.summary_line(result)
    else:
        data = lambada.load_lambada(args.data, tokenizer)
        result = lambada.evaluate_lambada(_logits_fn(args, source, topo), data, **common)
        line = lambada.summary_line(result)
    result.update(protocol=protocol, backend=args.backend, tp=topo.tp, ep=topo.ep, limit=args.limit)
    if source.checkpoint is not None:  # which checkpoint was evaluated, exactly
        result.update(checkpoint=str(source.checkpoint), checkpoint_step=source.step)
        if source.skipped:  # the latest did not verify: the JSON says so, beside the one evaluated
            result.update(checkpoints_skipped=list(source.skipped))
        if source.lora_base is not None:
            result.update(lora_base=str(source.lora_base))
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
            "--tp", str(args.tp), "--ep", str(getattr(args, "ep", 1)),
            "--protocol", getattr(args, "protocol", "megatron")]
    for flag, value in (("--tokenizer", args.tokenizer), ("--json", args.json), ("--limit", args.limit),
                        ("--stride", getattr(args, "stride", None)),
                        ("--lora-base", getattr(args, "lora_base", None))):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _pin_checkpoint(args: argparse.Namespace) -> None:
    """Check the input here; every worker then evaluates the checkpoint resolved (and, under tp, verified) here."""
    source = check_inputs(args)
    if source.checkpoint is not None:
        verify_before_workers(args, source.checkpoint)
        args.checkpoint = str(source.checkpoint)
    if source.lora_base is not None:  # a LoRA run's base: every worker reads the one resolved here
        verify_before_workers(args, source.lora_base)
        args.lora_base = str(source.lora_base)


def _run_eval(args: argparse.Namespace) -> int:
    return run_here_or_relaunch(args, "megazoo.eval.cli", _pin_checkpoint, _forwarded_argv, evaluate)


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint", metavar="DIR",
                       help="megazoo checkpoint of any layout: a training run's checkpoints/ folder (its latest good "
                            "checkpoint), one step_N directory, or the output of megazoo convert hf-to-megazoo")
    model.add_argument("--hf", metavar="DIR", help="Hugging Face directory (config.json + weights) of a family "
                       "megazoo convert reads: GPT-2, Llama, Qwen2, Mistral")
    parser.add_argument("--data", required=True, metavar="FILE", help="the evaluation data file")
    parser.add_argument("--lora-base", default=None, metavar="CKPT", help="--checkpoint of a LoRA run: its base "
                        "checkpoint (default: the checkpoint.load that run recorded)")
    parser.add_argument("--tokenizer", metavar="TOK", default=None,
                        help="GPT-2 BPE directory, tokenizer .json, sentencepiece .model or hf:NAME; default: the "
                             "tokenizer the checkpoint records (--checkpoint), the model directory's files (--hf)")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="megatron",
                        help="megatron (default: Megatron-LM's, the published GPT-2 / Megatron / T-NLG rows) or "
                             "lm-eval (lm-evaluation-harness's lambada_openai / wikitext numbers)")
    parser.add_argument("--json", metavar="OUT.json", default=None, help="write the result record here")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="score only the first N windows / examples (quick checks)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows / examples per forward (default 4)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (torchrun; default 1)")
    parser.add_argument("--ep", type=int, default=1, help=EP_HELP)
    parser.add_argument("--backend", choices=("megazoo", "transformers"), default="megazoo",
                        help="run the model through megazoo's GPT (default) or transformers (--hf only)")


def register(subparsers) -> argparse.ArgumentParser:
    """Add `eval` (with `wikitext103` and `lambada`) to the `megazoo` command's subparsers."""
    parser = subparsers.add_parser("eval", help="zero-shot WikiText-103 perplexity / LAMBADA accuracy; lm-eval tasks")
    tasks = parser.add_subparsers(dest="task", required=True)
    wiki = tasks.add_parser("wikitext103", help="perplexity: overlapping windows over the file (megatron) or "
                                                "lm-eval's per-page disjoint windows")
    _add_common_arguments(wiki)
    wiki.add_argument("--stride", type=int, default=None,
                      help="megatron protocol: window stride s, each window after the first scores its last s "
                           f"tokens (default {DEFAULT_STRIDE})")
    lamb = tasks.add_parser("lambada", help="strict last-word accuracy on LAMBADA (OpenAI's jsonl)")
    _add_common_arguments(lamb)
    for task_parser in (wiki, lamb):
        task_parser.set_defaults(func=_run_eval)
    register_harness(tasks)
    return parser


def main(argv: list[str] | None = None) -> int:
    """torchrun worker entry point (`python -m megazoo.eval.cli TASK ...`): reads the launcher's RANK/WORLD_SIZE."""
    from megazoo.workers.local import tp_worker

    parser = argparse.ArgumentParser(prog="megazoo eval")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    return tp_worker(args, args.func, evaluate)


if __name__ == "__main__":
    sys.exit(main())
