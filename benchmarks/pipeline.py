"""Pipeline bubble, throughput and activation memory per schedule, measured next to the theory.

    python benchmarks/pipeline.py [--m 8] [--steps 4] [--layers 8] [--schedules gpipe,1f1b,...] [--json out.json]
    python benchmarks/pipeline.py --overlap [--m 8] [--steps 3] [--layers 4] [--a2a-latency-ms 0,5] [--json out.json]

The measuring lives in the installed package (megazoo/recipes/reproduce/pipeline_bench.py, whose docstring gives
the method and the formulas; `megazoo reproduce pipeline-bubble` runs the same); this script prints the table.
On a 2-core CPU machine 4 ranks share 2 cores, so the measured bubble is inflated by time-slicing; the
activation counts are exact everywhere.

--overlap: DualPipe-V's forward/backward overlap under expert parallelism beside 1F1B, ZBV and DualPipe-V without
it, on an MoE model at pp 2 x ep 2: the bubble and the exposed all-to-all time per schedule, as fractions of the
schedule's wall time (megazoo/recipes/reproduce/overlap_bench.py says how each is measured, and that a latency
given with --a2a-latency-ms is emulated by a test double around the all-to-all, not a real link).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megazoo.recipes.reproduce.overlap_bench import markdown, measure_overlap
from megazoo.recipes.reproduce.pipeline_bench import SCHEDULES, measure_schedules


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step (train.grad_accum)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 4; 3 with --overlap)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default 8; 4 MoE blocks with --overlap)")
    parser.add_argument("--overlap", action="store_true",
                        help="the MoE rows: 1f1b, zbv, dualpipev and dualpipev + parallel.fb_overlap at pp 2 x ep 2")
    parser.add_argument("--a2a-latency-ms", default="0",
                        help="--overlap: comma-separated emulated all-to-all latencies (ms; 0: the plain gloo link)")
    parser.add_argument("--d-model", type=int, default=64, help="--overlap: the MoE model's width")
    parser.add_argument("--repeat", type=int, default=1,
                        help="--overlap: runs of every row (interleaved); the table shows medians")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, from " + ", ".join(SCHEDULES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.overlap:
        return _overlap(args, parser)
    args.steps, args.layers = args.steps or 4, args.layers or 8
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


def _overlap(args, parser) -> int:
    try:
        latencies = [float(x) for x in args.a2a_latency_ms.split(",")]
    except ValueError:
        parser.error(f"--a2a-latency-ms {args.a2a_latency_ms!r}: expected comma-separated numbers, e.g. 0,5")
    if args.m < 3 or (args.layers or 4) % 4 or any(x < 0 for x in latencies) or args.repeat < 1:
        parser.error(f"--overlap needs --m >= 3 (DualPipe-V at pp 2), --layers a multiple of 4 (4 virtual stages), "
                     f"latencies >= 0 and --repeat >= 1; got --m {args.m}, --layers {args.layers}, --a2a-latency-ms "
                     f"{args.a2a_latency_ms}, --repeat {args.repeat}")
    rows = measure_overlap(args.m, args.steps or 3, args.layers or 4, args.d_model, latencies, repeat=args.repeat,
                           report=lambda line: print(line, file=sys.stderr))
    print("\n".join(markdown(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
