"""LoRA vs full fine-tuning on the same model: tokens/s and peak memory, in one run, as ratios.

    python -m benchmarks.lora                              # d_model 512, 4 layers, vocab 8192, seq 128, rank 8
    python -m benchmarks.lora --d-model 768 --layers 6 --steps 4

Each variant runs the real Trainer (fp32, ZeRO-0, one process, synthetic tokens) in a fresh interpreter of its own,
so its peak resident set is its own: on CPU, torch's tensors live in malloc'd memory that tracemalloc does not
see, so the honest figure is the process's peak RSS (getrusage ru_maxrss), reported whole and as its growth over
the RSS right after the model was built (what training adds: gradients, Adam moments, activations). The
optimizer's own count of its model states (memory_bytes: params, grads, optimizer) is printed beside it. tokens/s
is the mean of the timed steps after one warm-up step. Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VARIANTS = ("full", "lora")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _table(args, variant: str) -> dict:
    lora = {"rank": args.rank, "alpha": 2.0 * args.rank, "targets": ["qkv", "o", "up", "down"]} \
        if variant == "lora" else {}
    return {
        "model": {"preset": "gpt2-tiny", "n_layer": args.layers, "d_model": args.d_model, "n_head": args.d_model // 64,
                  "d_ff": 4 * args.d_model, "vocab_size": args.vocab, "n_positions": args.seq, "dropout": 0.0,
                  "attn_dropout": 0.0},
        "train": {"steps": args.steps + 1, "micro_batch": args.micro_batch, "seq_len": args.seq, "precision": "fp32",
                  "warmup_steps": 1},
        "data": {"source": "synthetic", "synthetic_tokens": 200_000},
        "logging": {"progress": False}, "checkpoint": {"at_end": False}, "sample": {"tokens": 0},
        "lora": lora,
    }


def measure(args, variant: str) -> dict:
    """One variant in this process: the Trainer's steps, its RSS and its optimizer's model-state bytes."""
    import torch

    from megazoo.parallel.topology import Topology
    from megazoo.recipes.config import Recipe, from_dict
    from megazoo.recipes.resolve import resolve
    from megazoo.recipes.training.trainer import Trainer

    torch.set_num_threads(args.threads)
    res = resolve(from_dict(Recipe, _table(args, variant)))
    trainer = Trainer(res, Topology.solo())
    rss_built = _rss_bytes()
    trainer.train_step(0)  # warm-up: allocates gradients and Adam moments
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        trainer.train_step(step)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    params = [p for p in trainer.model.parameters()]
    return {"variant": variant, "tokens_per_s": res.tokens_per_step * args.steps / seconds,
            "peak_rss_bytes": peak, "rss_after_build_bytes": rss_built, "training_growth_bytes": peak - rss_built,
            "model_states": trainer.zero.memory_bytes(),
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "parameters": sum(p.numel() for p in params)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (both variants alike)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child process's one variant
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(measure(args, args.variant)))
        return 0
    own = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = {}
    for variant in VARIANTS:  # a fresh interpreter each: its peak RSS is its own
        out = subprocess.run([sys.executable, "-m", "benchmarks.lora", *own, "--variant", variant],
                             check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    ratios = {"tokens_per_s": lora["tokens_per_s"] / full["tokens_per_s"],
              "peak_rss": lora["peak_rss_bytes"] / full["peak_rss_bytes"],
              "training_growth": lora["training_growth_bytes"] / full["training_growth_bytes"],
              "model_states": sum(lora["model_states"].values()) / sum(full["model_states"].values())}
    print(json.dumps({"config": vars(args), "results": results, "lora_over_full": ratios}, indent=2))
    mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    print("\n| | full fine-tune | LoRA r=%d | LoRA / full |" % args.rank)
    print("|---|---|---|---|")
    print(f"| trainable parameters | {full['trainable_parameters']:,} | {lora['trainable_parameters']:,} | "
          f"{lora['trainable_parameters'] / full['trainable_parameters']:.4f} |")
    print(f"| tokens/s | {full['tokens_per_s']:.0f} | {lora['tokens_per_s']:.0f} | {ratios['tokens_per_s']:.2f} |")
    print(f"| peak RSS | {mb(full['peak_rss_bytes'])} | {mb(lora['peak_rss_bytes'])} | {ratios['peak_rss']:.2f} |")
    print(f"| RSS growth while training | {mb(full['training_growth_bytes'])} | {mb(lora['training_growth_bytes'])}"
          f" | {ratios['training_growth']:.2f} |")
    print(f"| model states (params+grads+Adam) | {mb(sum(full['model_states'].values()))} | "
          f"{mb(sum(lora['model_states'].values()))} | {ratios['model_states']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
