"""`megazoo generate (CKPT | --hf DIR) --prompt TEXT --max-new-tokens N [--chat [TEMPLATE]] [--temperature T]
[--top-k K] [--top-p P] [--seed S] [--tp N] [--ep E] [--tokenizer TOK] [--lora-base CKPT]`: continue a prompt with a
trained model, or answer it as a fine-tuned chat model; the text goes to stdout.

CKPT is a run's `checkpoints/` folder (its latest good checkpoint) or one `step_N` directory; the tokenizer is
the one the checkpoint records (models/loading.py), or --tokenizer. A LoRA run's checkpoint (adapters only) runs
as the run trained it, the adapters on the base the run recorded (or --lora-base): no export with --merge-lora
first. --hf DIR reads a Hugging Face folder of any family `megazoo convert` reads (models/hf/families.py).
--chat answers the prompt as one user turn in the chat template the fine-tuning run trained with (recorded in its
checkpoint), else the tokenizer's own (an HF folder's), or the one named (chatml, llama3, tokenizer), and stops at
the template's end of turn, which is not printed.
Decoding (models/generation/generate.py) uses a KV cache and stops early at the tokenizer's end-of-text id.
Everything is checked in this process before any worker starts (exit 2 and one line naming the value); with
--tp N > 1 the command relaunches itself under torchrun (`python -m megazoo.recipes.generate_cli`), every rank
loads only its own shards and decodes in step, and rank 0 prints; --ep E (an MoE model) runs E x N workers, each
holding 1/E of the routed experts (the experts' memory is split; every rank decodes the same tokens).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from megazoo.workers.tp_command import EP_HELP, check_ep, run_here_or_relaunch, verify_before_workers

RECORDED = "recorded"  # --chat without a name: the template the checkpoint's fine-tuning run trained with


@dataclass(frozen=True)
class Source:
    cfg: object  # models.config.ModelConfig
    tokenizer: object
    ckpt: object | None  # models.loading.OpenCheckpoint (CKPT), None for --hf
    template: str | None  # --chat: the chat template's name (data/sft/chat_template.py), else None


def _template(args: argparse.Namespace, ckpt, tokenizer) -> str | None:
    """--chat's template: the one named, else the one the fine-tuning run recorded, else the tokenizer's own
    (an HF folder's, or a converted checkpoint's, tokenizer_config.json chat_template)."""
    if args.chat is None:
        return None
    if args.chat != RECORDED:
        return args.chat
    from megazoo.data.sft.chat_template import BUILTIN_TEMPLATES, has_own_template
    from megazoo.parallel.checkpoint.io import read_common

    recorded = read_common(ckpt.path).get("chat_template") if ckpt is not None else None
    if recorded:
        return recorded
    if has_own_template(tokenizer):
        return "tokenizer"
    where = f"checkpoint {ckpt.path}" if ckpt is not None else f"--hf {args.hf}"
    raise ValueError(f"--chat: {where} records no chat template (it was not fine-tuned on an SFT dataset by megazoo) "
                     f"and its tokenizer has none: name one, --chat {' | '.join(BUILTIN_TEMPLATES)}")


def _check(args: argparse.Namespace) -> Source:
    from megazoo.models.generation.generate import check_sampling

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} is invalid: use 0 or more")
    if (args.checkpoint is None) == (args.hf is None):
        raise ValueError("give the model as CKPT (a megazoo checkpoint) or --hf DIR, one of the two")
    check_sampling(args.temperature, args.top_k, args.top_p)
    from megazoo.workers.tp_command import say

    ckpt = None
    if args.hf is not None:
        from megazoo.data.tokenizers.loading import load_tokenizer
        from megazoo.models.hf.families import read_hf_config, tokenizer_spec

        cfg = read_hf_config(args.hf)[1]
        tokenizer = load_tokenizer(args.tokenizer or tokenizer_spec(args.hf))
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"the model's vocabulary ({cfg.vocab_size} ids, {args.hf}) does not match the tokenizer "
                             f"({tokenizer.vocab_size} ids): pass the model's own --tokenizer")
    else:
        from megazoo.models.loading import open_checkpoint

        ckpt = open_checkpoint(args.checkpoint, args.tokenizer, report=say, need_base=True,
                               lora_base=args.lora_base)
        cfg, tokenizer = ckpt.cfg, ckpt.tokenizer
    if args.tp < 1 or cfg.n_head % args.tp:
        raise ValueError(f"--tp {args.tp} must be a positive divisor of the model's n_head = {cfg.n_head}")
    check_ep(args.ep, cfg)
    if getattr(args, "speculative", False) and args.ep > 1:  # speculative_decode has no agreement over ep ranks
        raise ValueError(f"--speculative decodes at --ep 1 only (not {args.ep}): each ep rank would accept or reject "
                         "the drafts on its own logits, with nothing keeping the ranks' tokens in step; valid: --ep 1")
    if getattr(args, "speculative", False) and (not cfg.mtp_depth or args.temperature != 0):
        raise ValueError(f"--speculative drafts with the model's multi-token prediction module and decodes greedily: "
                         f"model.mtp_depth = {cfg.mtp_depth}, --temperature {args.temperature}; valid: a model "
                         "trained with mtp_depth >= 1 and --temperature 0")
    template = _template(args, ckpt, tokenizer)
    if template is not None:
        from megazoo.data.sft.chat_template import resolve_template

        resolve_template(tokenizer, template)  # an unknown name, or "tokenizer" without one: refused here
    if not tokenizer.encode(args.prompt):
        raise ValueError("--prompt encodes to no tokens: give some text")
    return Source(cfg, tokenizer, ckpt, template)


def continuation(args: argparse.Namespace, topo, report=None) -> str:
    """Decode on this rank (collective under tp) and return the new text (--chat: the answer alone); `report`
    gets --speculative's line (forwards, tokens, drafts accepted per step)."""
    from megazoo.models.generation.generate import decode, new_cache

    source = _check(args)
    tokenizer = source.tokenizer
    from megazoo.models.loading import load_gpt, load_gpt_from_hf

    # each rank reads only its own tp slices and ep experts, from the checkpoint or the HF folder
    model = load_gpt(source.ckpt, topo) if source.ckpt is not None else load_gpt_from_hf(args.hf, topo)
    eos, marker = tokenizer.eod_id, None
    if source.template is None:
        prompt = tokenizer.encode(args.prompt)
    else:  # one user turn, exactly as the fine-tuning run rendered its prompts; stop at its end of turn
        from megazoo.data.sft.chat_template import chat_prompt, end_of_turn, resolve_template

        prompt = chat_prompt(tokenizer, source.template, args.prompt)
        marker = end_of_turn(resolve_template(tokenizer, source.template)[1])
    def stop(new: list[int]) -> bool:
        return new[-1] == eos or (marker is not None and marker in tokenizer.decode(new))

    if getattr(args, "speculative", False):  # the MTP module drafts, the model verifies (greedy tokens)
        from megazoo.models.deepseek.speculative import speculative_decode

        result = speculative_decode(model, prompt, args.max_new_tokens, stop=stop)
        ids = result.ids
        if report is not None:
            report(f"speculative: {len(result.accepted) + 1} forwards for {len(ids) - len(prompt)} tokens "
                   f"({result.tokens_per_forward:.2f} per forward after the prompt's); drafts accepted per step: "
                   f"{' '.join(str(a) for a in result.accepted) or '-'}")
    else:
        cache = new_cache(model.cfg)
        ids = decode(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                     top_p=args.top_p, seed=args.seed, cache=cache, stop=stop)
        if getattr(args, "verbose", False) and topo.rank == 0:
            print(cache_line(model.cfg, cache), file=sys.stderr, flush=True)
    new = ids[len(prompt):]
    if new and new[-1] == eos:  # the end-of-text mark ends the text; it is not part of it
        new = new[:-1]
    text = tokenizer.decode(new)
    if marker is not None:
        from megazoo.data.sft.chat_template import cut_at_end_of_turn

        text = cut_at_end_of_turn(text, marker)[0]
    return text


def cache_line(cfg, cache) -> str:
    """--verbose: the decoding cache's bytes per token (one sequence, this rank, every layer) and what makes them."""
    layers, total = cfg.n_layer, cache.bytes_per_token()
    if cfg.mla:
        how = (f"latent cache: (kv_lora_rank {cfg.kv_lora_rank} + qk_rope_head_dim {cfg.qk_rope_head_dim}) x "
               f"{layers} layers x {total // (layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))} bytes")
    else:
        how = f"key/value cache: 2 x this rank's heads x head dim x {layers} layers x dtype bytes"
    return f"cache bytes per token: {total} ({how})"


def _forwarded_argv(args: argparse.Namespace) -> list[str]:
    argv = [str(args.checkpoint)] if args.checkpoint is not None else ["--hf", str(args.hf)]
    argv += ["--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens),
             "--temperature", repr(args.temperature), "--top-k", str(args.top_k), "--top-p", repr(args.top_p),
             "--seed", str(args.seed), "--tp", str(args.tp), "--ep", str(args.ep)]
    argv += ["--verbose"] if args.verbose else []
    for flag, value in (("--tokenizer", args.tokenizer), ("--lora-base", args.lora_base), ("--chat", args.chat)):
        if value:
            argv += [flag, str(value)]
    if args.speculative:
        argv.append("--speculative")
    return argv


def _pin_checkpoint(args: argparse.Namespace) -> None:
    """Check the input here; every worker then decodes the checkpoint (and a LoRA run's base) resolved (and,
    under tp, verified) here."""
    source = _check(args)
    if source.ckpt is None:
        return
    for step_dir in (source.ckpt.path, source.ckpt.base):
        if step_dir is not None:
            verify_before_workers(args, step_dir)
    args.checkpoint = str(source.ckpt.path)
    if source.ckpt.base is not None:
        args.lora_base = str(source.ckpt.base)
    if source.template is not None:
        args.chat = source.template


def _decode_and_print(args: argparse.Namespace, topo) -> None:
    lines = []
    text = continuation(args, topo, report=lines.append)
    if topo.rank == 0:  # one print: under --ep several ranks are tp rank 0
        print(text, flush=True)
        for line in lines:
            print(line, flush=True)


def _run(args: argparse.Namespace) -> int:
    return run_here_or_relaunch(args, "megazoo.recipes.generate_cli", _pin_checkpoint, _forwarded_argv,
                                _decode_and_print)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", nargs="?", default=None,
                        help="a run's checkpoints/ folder (its latest good checkpoint) or one step_N directory; a "
                             "LoRA run's too (its adapters on the base it recorded)")
    parser.add_argument("--hf", metavar="DIR", default=None, help="instead of CKPT: a Hugging Face folder of a "
                        "family megazoo convert reads (GPT-2, Llama, Qwen2, Mistral)")
    parser.add_argument("--prompt", required=True, help="the text to continue (--chat: the user's turn)")
    parser.add_argument("--chat", nargs="?", const=RECORDED, default=None, metavar="TEMPLATE",
                        help="answer the prompt as a user turn in the chat template the fine-tuning run trained "
                             "with (recorded in its checkpoint), or the one named (chatml, llama3, tokenizer); the "
                             "answer stops at the template's end of turn")
    parser.add_argument("--lora-base", default=None, metavar="CKPT",
                        help="a LoRA run's base checkpoint (default: the checkpoint.load its run recorded)")
    parser.add_argument("--max-new-tokens", type=int, required=True, metavar="N",
                        help="at most N new tokens (fewer when the model ends the text)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample from the smallest set holding probability P (1: off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    parser.add_argument("--speculative", action="store_true",
                        help="greedy self-speculative decoding: the model's multi-token prediction module drafts "
                             "the token after next, the model verifies it (the same tokens as without; prints "
                             "the drafts accepted per step)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (torchrun; default 1)")
    parser.add_argument("--ep", type=int, default=1, help=EP_HELP)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer spec (default: the one the checkpoint records)")
    parser.add_argument("--verbose", action="store_true",
                        help="also print (to stderr) the decoding cache's bytes per token")


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
