"""Pipeline bubble, throughput and activation memory per schedule, measured next to the theory.

    python benchmarks/pipeline.py [--m 8] [--steps 4] [--layers 8] [--schedules gpipe,1f1b,...] [--json out.json]

The measuring lives in the installed package (megazoo/recipes/reproduce/pipeline_bench.py, whose docstring gives
the method and the formulas; `megazoo reproduce pipeline-bubble` runs the same); this script prints the table.
On a 2-core CPU machine 4 ranks share 2 cores, so the measured bubble is inflated by time-slicing; the
activation counts are exact everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megazoo.recipes.reproduce.pipeline_bench import SCHEDULES, measure_schedules


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step (train.grad_accum)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, from " + ", ".join(SCHEDULES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    chosen = args.schedules.split(",")
    unknown = [s for s in chosen if s not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: {', '.join(unknown)} invalid; valid: {', '.join(SCHEDULES)}")
    rows = measure_schedules(args.m, args.steps, args.layers, chosen, report=lambda line: print(line, file=sys.stderr))
    print("| pp | schedule | v | m | bubble measured | bubble theory | bubble ideal (lists) | tokens/s | "
          "F / B / W compute s per rank | live micro-batches per stage | first stage: live x b*s*d fp32 (MiB) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for r in rows:
        k = r["compute_s_per_rank"]
        print(f"| {r['pp']} | {r['schedule']} | {r['v']} | {r['m']} | {r['bubble_measured']:.3f} | "
              f"{r['bubble_theory']:.3f} | {r['bubble_ideal']:.3f} | {r['tokens_per_s']:.0f} | "
              f"{k['F']:.2f} / {k['B']:.2f} / {k['W']:.2f} | {r['live_per_stage']} | "
              f"{r['activation_mb_first_stage']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
