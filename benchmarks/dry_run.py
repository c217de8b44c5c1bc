"""Dry runs of the shipped recipes at their full world size: measured peak per role beside the planner, the GPU's
memory, dp communication per step beside the ZeRO paper's volume, FLOPs beside the formula, seconds.

    python benchmarks/dry_run.py [--recipes tnlg-17b gpt-1t] [--json out.json] [--set k=v ...] [--whole]

Each recipe runs `megazoo plan --recipe R --dry-run`'s code (recipes/dry_run/run.py) in this process, one role
after another, and prints one markdown table (the README's "Dry run at the real size" table is this output for
tnlg-17b and gpt-1t). GB = 1e9 bytes. `python benchmarks/dry_run.py --json recipes/reproduce/dry_run_results.json`
records what `megazoo reproduce claims` shows as measured.

The two pipeline recipes run pp micro-batches per step instead of all they train with
(recipes/dry_run.pipeline_depth_overrides; --whole: all of them): gpt-1t's 1,536 and gpt3-175b's 128 take hours
here, and the peak is reached with pp.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazoo.recipes.planner.zero import GB  # noqa: E402
from megazoo.recipes.dry_run.run import dry_run, load, pipeline_depth_overrides, stated_gpu  # noqa: E402
from megazoo.recipes.dry_run.report import report  # noqa: E402
from megazoo.recipes.planner.fit import parse_gpu  # noqa: E402

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHIPPED = ("gpt2-117m", "gpt2-345m", "gpt2-774m", "gpt2-1.5b", "megatron-8.3b", "tnlg-17b", "gpt-100b",
           "gpt3-175b", "gpt-1t")


def measure(name: str, overrides=(), whole: bool = False) -> dict:
    path = RECIPES / f"{name}.toml"
    res = load(path, overrides)
    fewer = [] if whole else pipeline_depth_overrides(res)
    if fewer:
        res = load(path, fewer + list(overrides))
    gpu = stated_gpu(path) or "32"
    start = time.perf_counter()
    results = dry_run(res)
    rep = report(res, results, parse_gpu(gpu)[0], time.perf_counter() - start)
    rep.update(recipe=name, gpu=gpu)
    return rep


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.0f}%"


def table(reports: list[dict]) -> str:
    lines = ["| recipe | ranks | role (rank: stage, ranks it stands for) | measured peak GB | planner GB | diff | "
             "GPU GB | fits | dp comm GB/step (measured / paper) | FLOPs counted / formula | dry-run s |",
             "|:---|---:|:---|---:|---:|---:|---:|:---|---:|---:|---:|"]
    for rep in reports:
        for row in rep["roles"]:
            flops = row["flops"] / row["formula_flops"] if row["formula_flops"] else float("nan")
            lines.append(
                f"| {rep['recipe']} | {rep['world_size']} | {row['rank']}: stage {row['pp_stage']}, "
                f"{len(row['ranks'])} | {row['measured_peak_bytes'] / GB:.2f} | {row['planned_peak_bytes'] / GB:.2f} | "
                f"{_pct(row['relative_difference'])} | {rep['gpu_memory_gb']:g} | {'yes' if rep['fits'] else 'no'} | "
                f"{row['dp_ring_bytes'] / GB:.2f} / {row['paper_dp_comm_bytes'] / GB:.2f} | {flops:.3f} | "
                f"{row['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(SHIPPED), help="recipe names under recipes/")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--json", default=None, help="also write the reports here")
    parser.add_argument("--whole", action="store_true", help="every micro-batch of gpt-1t's and gpt3-175b's step")
    args = parser.parse_args(argv)
    reports = []
    for name in args.recipes:
        reports.append(measure(name, args.set, args.whole))
        print(f"{name}: {reports[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    print(table(reports))
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
