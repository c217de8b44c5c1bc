"""The dry run on fake CUDA next to the CPU dry run, per recipe: peak bytes, tp and dp bytes, what was stubbed.

    python -m benchmarks.fake_cuda [--recipe PATH [--set k=v ...]] ... [--tiny] [--before] [--json OUT]

--tiny adds tests/recipes/planner/test_dry_run_cuda.py's small configurations (dp ZeRO 0-3 in bf16/fp16, offload, tp, pp). Each
row: the device peak of each role (MB), ZeRO-Offload's host bytes, the bytes each rank's collectives carry on its
tp group and on its dp group (tensor bytes, summed over the step), and the CUDA calls the fake device answered.
All fake-CUDA jobs run in one fresh interpreter (recipes/dry_run/cuda.run_jobs). --before adds, for every
recipe, a fake-CUDA row without the LayerNorm's cast back to its input's dtype (kernels/layer_norm.in_input_dtype):
the tp bytes and peak as they were before that fix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from megazoo.recipes.dry_run.run import load, roles, run_role
from megazoo.recipes.dry_run.cuda import run_jobs
from megazoo.recipes.dry_run.report import report


@contextlib.contextmanager
def without_layer_norm_cast():
    """The fake-CUDA step as it ran before kernels/layer_norm.in_input_dtype: torch's fp32 output kept."""
    from megazoo.kernels import layer_norm

    cast = layer_norm.in_input_dtype
    layer_norm.in_input_dtype = lambda y, x: y
    try:
        yield
    finally:
        layer_norm.in_input_dtype = cast


def cpu_report(path: str, sets: list[str]) -> dict:
    res = load(path, sets)
    return report(res, [run_role(res, role) for role in roles(res)], 80, 0.0)


def _bytes_on(row: dict, dim: str, par) -> int:
    """Bytes of the collectives on the `dim` group ("tp", "dp"); DeviceMesh hands out the default group when
    that dim is the whole world."""
    whole = getattr(par, dim) == par.dp * par.tp * par.pp
    return sum(b for op, desc, _, b in row.get("by_group", [])
               if desc.startswith(f"mesh_{dim}") or (whole and desc == "default_pg"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", action="append", default=[], help="a recipe to run (repeatable)")
    parser.add_argument("--set", action="append", default=[], help="override for every --recipe")
    parser.add_argument("--tiny", action="store_true", help="the test suite's small configurations")
    parser.add_argument("--before", action="store_true", help="also each recipe without the LayerNorm fix")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    jobs: dict[str, tuple[str, list[str]]] = {r: (r, list(args.set)) for r in args.recipe}
    tmp = tempfile.TemporaryDirectory(prefix="megazoo-fake-cuda-bench-")
    if args.tiny:
        tests = Path(__file__).resolve().parents[1] / "tests"  # the test's configurations and their helpers
        sys.path[:0] = [str(tests / "recipes" / "planner"), str(tests)]
        from test_dry_run_cuda import CONFIGS, _path
        jobs.update({name: (str(_path(Path(tmp.name), name)), []) for name in CONFIGS})
    specs = [{"recipe": p, "sets": s, "gpu_memory_gb": 80} for p, s in jobs.values()]
    if args.before:
        before = {f"{name} (before: fp32 LayerNorm)": job for name, job in jobs.items()}
        specs += [{"recipe": p, "sets": s, "gpu_memory_gb": 80,
                   "inject": "benchmarks.fake_cuda:without_layer_norm_cast"} for p, s in before.values()]
        jobs.update(before)
    cuda = run_jobs(specs)
    rows = []
    print("| recipe | role | CPU peak MB | fake-CUDA peak MB | host MB (CPU / CUDA) | tp bytes (CPU / CUDA) | "
          "dp bytes (CPU / CUDA) | stubbed (not executed) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for (name, (path, sets)), fake in zip(jobs.items(), cuda):
        host, par = cpu_report(path, sets), load(path, sets).recipe.parallel
        if "error" in fake:
            print(f"| {name} | - | - | error: {fake['error'][:80]} | | | | |")
            continue
        stubbed = ", ".join(f"{r['call']} x{r['count']}" for r in fake["not_executed"])
        for h, f in zip(host["roles"], fake["roles"]):
            row = dict(recipe=name, rank=h["rank"], cpu_peak=h["measured_peak_bytes"],
                       cuda_peak=f["measured_peak_bytes"], cpu_host=h["host_bytes"], cuda_host=f["host_bytes"],
                       cpu_tp=_bytes_on(h, "tp", par), cuda_tp=_bytes_on(f, "tp", par),
                       cpu_dp=h["dp_ring_bytes"], cuda_dp=f["dp_ring_bytes"], stubbed=fake["not_executed"])
            rows.append(row)
            print(f"| {name} | rank {row['rank']} | {row['cpu_peak'] / 1e6:.2f} | {row['cuda_peak'] / 1e6:.2f} | "
                  f"{row['cpu_host'] / 1e6:.2f} / {row['cuda_host'] / 1e6:.2f} | {row['cpu_tp']:,} / "
                  f"{row['cuda_tp']:,} | {row['cpu_dp']:,.0f} / {row['cuda_dp']:,.0f} | {stubbed} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
