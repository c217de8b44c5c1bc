"""`megazoo plan --recipe R --dry-run [--device cuda]`: the flags, the run (in this process on the CPU, or on fake
CUDA in a fresh interpreter: recipes/dry_run/cuda.py), the report (recipes/dry_run/report.py) and
the exit status: 0 fits, 3 does not, 2 bad flags, 1 the step itself failed (a role's error is printed).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from megazoo.recipes.dry_run.run import dry_run, load, stated_gpu
from megazoo.recipes.dry_run.report import report, to_text
from megazoo.recipes.planner.fit import parse_gpu

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_USAGE, EXIT_STEP_FAILED = 0, 3, 2, 1


class DryRunUsageError(Exception):
    """Bad flags (exit 2); the message names the flag."""


def capacity(args) -> float:
    if args.gpu_memory and args.gpu:
        raise DryRunUsageError("--gpu-memory and --gpu: give one of them, not both")
    text = args.gpu_memory or args.gpu or stated_gpu(args.recipe)
    if not text:
        raise DryRunUsageError(f"--gpu-memory: {args.recipe} names no GPU in its header; give --gpu-memory GB")
    try:
        return parse_gpu(text)[0]
    except ValueError as err:
        raise DryRunUsageError(str(err).replace("--gpu-memory", "--gpu" if args.gpu else "--gpu-memory")) from None


def run(args) -> int:
    """The `plan --dry-run` subcommand: 0 fits, 3 does not, 2 on bad flags."""
    try:
        if not args.recipe:
            raise DryRunUsageError("--dry-run needs --recipe RECIPE.toml")
        if args.json not in (None, "-") and not Path(args.json).resolve().parent.is_dir():
            raise DryRunUsageError(f"--json {args.json}: its directory does not exist")
        gb = capacity(args)
        from megazoo.recipes.config import RecipeError
        try:
            res = load(args.recipe, args.set or [])
        except RecipeError as err:
            raise DryRunUsageError(f"--recipe {args.recipe}: {err}") from None
    except DryRunUsageError as err:
        print(f"megazoo plan: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    start = time.perf_counter()
    if getattr(args, "device", "cpu") == "cuda":  # in a fresh interpreter with the fake CUDA shim
        from megazoo.parallel.simulation.fake_cuda import FakeCudaUnavailable
        from megazoo.recipes.dry_run.cuda import run_jobs
        try:
            rep = run_jobs([{"recipe": str(args.recipe), "sets": list(args.set or []), "gpu_memory_gb": gb}])[0]
        except FakeCudaUnavailable as err:
            print(f"megazoo plan: error: --device cuda: {err}", file=sys.stderr)
            return EXIT_USAGE
        if "error" in rep:  # the step itself raised on fake CUDA: a bug of the GPU path, not of the flags
            print(f"megazoo plan: the training step failed on fake CUDA: {rep['error']}", file=sys.stderr)
            return EXIT_STEP_FAILED
    else:
        from megazoo.recipes.dry_run.run import RoleFailed
        try:
            results = dry_run(res)
        except RoleFailed as err:  # the step raised in this process: name the role and the error, exit 1
            print(f"megazoo plan: {err}", file=sys.stderr)
            return EXIT_STEP_FAILED
        rep = report(res, results, gb, 0.0)
    rep["seconds"] = time.perf_counter() - start
    if args.json == "-":
        print(json.dumps(rep, indent=2))
    else:
        print(to_text(res, rep))
        if args.json:
            Path(args.json).write_text(json.dumps(rep, indent=2))
            print(f"json: {args.json}")
    return EXIT_FITS if rep["fits"] else EXIT_DOES_NOT_FIT
