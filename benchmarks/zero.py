"""ZeRO stages 0-3 against torch DDP and torch FSDP2: throughput, memory, and the largest GPT that trains.

    python -m benchmarks.zero                      # everything (about 25-30 minutes on 2 CPU cores)
    python -m benchmarks.zero --part throughput --quick
    python -m benchmarks.zero --part largest --json out.json

The measuring (models, workers, rounds, ratios, the ladder search) lives in the installed package,
megazoo/recipes/reproduce/zero_bench.py, whose docstring says what each part measures; this script parses the
options and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from megazoo.recipes.reproduce.zero_bench import IMPLS, MEMORY_BOUND, PHASES, run_largest, run_throughput
from megazoo.workers.guarded import GiB


# ---- printing ------------------------------------------------------------------------------------------------
def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def print_throughput(rows) -> None:
    print("\n| model | params | impl | seq x mb x dp | tokens/s | vs DDP | vs FSDP2 | step s | CPU s/step/rank "
          "| load 1m | peak RSS/rank GB (r0, r1) | params+optimizer states/rank GB | comm/step/rank MB | last loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratio = lambda r, impl: "-" if r.get(f"vs_{impl}") is None else f"{r[f'vs_{impl}']:.2f}x"  # noqa: E731
    for r in rows:
        rss = ", ".join(_gb(x) for x in r.get("peak_rss") or [])
        if r["impl"] == "idle rank":
            print(f"| - | - | idle rank (torch imported, forked) | - | - | - | - | - | - | - | {rss} | - | - | - |")
        elif r["failed"]:
            print(f"| {r['model']} | - | {r['impl']} | - | FAILED: {r['failed']} |" + " |" * 9)
        else:
            comm = "-" if r["comm_bytes"] is None else f"{r['comm_bytes'] / 1e6:.1f}"
            print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['impl']} | {r['seq']} x {r['micro_batch']} x 2 "
                  f"| {r['tokens_per_s']:.0f} | {ratio(r, 'ddp')} | {ratio(r, 'fsdp2')} | {r['step_s']:.3f} "
                  f"| {r['cpu_s']:.2f} | {r['loadavg_1m']:.1f} | {rss} | {_gb(max(r['state_bytes']))} | {comm} "
                  f"| {r['losses'][-1]:.6f} |")
    print("\nPer-phase seconds per step (mean over the timed window, slowest rank per phase, median over rounds; "
          "all-gather wait is part of "
          "the optimizer phase for stages 1-2 and of forward/backward for stage 3):\n")
    print("| model | impl | " + " | ".join(PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for r in rows:
        if r.get("phases"):
            print(f"| {r['model']} | {r['impl']} | " + " | ".join(f"{r['phases'][k]:.3f}" for k in PHASES) + " |")


def print_largest(out) -> None:
    print(f"\nLargest GPT completing 3 steps (fp32 AdamW, micro-batch 1 x seq {out['seq']}, {out['world']} ranks, "
          f"memory budget {out['budget_bytes'] / GiB:.1f} GiB):\n")
    print("| stage | n_layer x d_model (heads) | params | result | step s | peak RSS/rank GB (max) | wall s |")
    print("|---|---|---|---|---|---|---|")
    for a in out["attempts"]:
        L, d, h = a["shape"]
        result = "ok" if a["ok"] else f"failed: {a['failed']}"
        step = "-" if a["step_s"] is None else f"{a['step_s']:.1f}"
        rss = _gb(max(a["peak_rss"])) if a["peak_rss"] else "-"
        print(f"| {a['stage']} | {L} x {d} ({h}) | {a['params'] / 1e6:.0f}M | {result} | {step} | {rss} "
              f"| {a['wall_s']:.0f} |")
    print()
    for stage, best in out["largest"].items():
        print(f"largest at ZeRO stage {stage}: "
              + (f"{best['params'] / 1e6:.0f}M parameters ({best['shape'][0]} x {best['shape'][1]})" if best
                 else "none of the ladder"))
    if out["ratio"]:
        print(f"largest stage / stage 0: {out['ratio']:.2f}x the parameters")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zero", description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "throughput", "largest"), default="all")
    p.add_argument("--quick", action="store_true", help="tiny model only, 1 warm-up + 2 timed steps")
    p.add_argument("--models", nargs="+", choices=(MEMORY_BOUND[0], "gpt2-117m"), default=None,
                   help="throughput: only these models (default both)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="throughput: only these implementations (ratios need ddp / fsdp2 among them)")
    p.add_argument("--seq", type=int, default=256, help="sequence length for gpt2-117m")
    p.add_argument("--micro-batch", type=int, default=1, help="micro batch per rank for gpt2-117m")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3,
                   help="throughput: interleaved rounds (medians of step time and of per-round ratios; RSS: max)")
    p.add_argument("--largest-seq", type=int, default=64)
    p.add_argument("--largest-stages", type=lambda v: [int(x) for x in v.split(",")], default=[0, 3],
                   help="largest: comma-separated ZeRO stages to search (e.g. 0,1,2,3)")
    p.add_argument("--reserve-gib", type=float, default=4.0,
                   help="largest: memory left to the rest of the machine (other jobs may share it); the ranks are "
                        "killed when MemAvailable falls under it")
    p.add_argument("--default-malloc", action="store_true", help="keep glibc's dynamic mmap threshold")
    p.add_argument("--timeout", type=float, default=900, help="seconds per largest-model attempt")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.steps, args.rounds = 1, 2, 1
    results = {"torch": torch.__version__, "cpus": os.cpu_count(),
               "mem_total_gib": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GiB}
    if args.part in ("all", "throughput"):
        results["throughput"] = run_throughput(args)
        print_throughput(results["throughput"])
    if args.part in ("all", "largest"):
        results["largest"] = run_largest(args)
        print_largest(results["largest"])
    print("\n" + json.dumps(results, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
