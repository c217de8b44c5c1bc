"""`megazoo verify RECIPE|NAME [--steps N] [--set k=v ...] [--json OUT] [--precision own] [--device cuda]`: does
my layout compute the same function?

Runs the recipe's own features at degree <= 2 on this machine (recipes/verify/shrink.py), on its architecture
shrunk to a few layers, in fp64, and holds losses, gradient norms, the validation loss and the final full
parameters to one process (recipes/verify/compare.py). Prints which features ran, what was shrunk, a table per
quantity and a verdict. Exit 0: every quantity within 1e-10; 1: some quantity deviated (or a rank failed);
2: bad input (the recipe, an override, --steps, --device cuda without enough GPUs), before any process starts.
`--precision own` runs both sides in the recipe's precision against a data-parallel reference, with that
precision's tolerances; `--device cuda` does so on GPUs (one per rank) with a truncated model at realistic widths
(recipes/verify/precision.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.config import RecipeError, load_recipe

if TYPE_CHECKING:  # torch-heavy: imported when the command runs, not for `megazoo verify --help`
    from megazoo.recipes.verify.compare import Outcome, Quantity
    from megazoo.recipes.verify.shrink import VerifyPlan


def _layout_text(res) -> str:
    par = res.recipe.parallel
    parts = [f"{k}={getattr(par, k)}" for k in ("dp", "tp", "pp", "cp") if getattr(par, k) > 1] or ["one process"]
    return f"{' x '.join(parts)} ({res.world_size} process{'es' if res.world_size > 1 else ''})"


def _number(x) -> str:
    return "-" if x is None else f"{x:.10g}" if isinstance(x, float) else str(x)


def _print_quantity(q: Quantity) -> None:
    verdict = "pass" if q.passed else "FAIL"
    print(f"\n{q.name} ({q.how}): max deviation {q.deviation:.2e} at {q.worst or '-'}, tolerance "
          f"{q.tolerance:.0e}: {verdict}")
    if q.rows:
        print(f"  {'step':>4}  {'one process':>20}  {'layout (rank 0)':>20}  {'deviation':>10}")
        for step, expected, got, dev in q.rows:
            print(f"  {step:>4}  {_number(expected):>20}  {_number(got):>20}  {dev:>10.2e}")


def report(name: str, vp: VerifyPlan, outcome: Outcome) -> None:
    print(f"megazoo verify {name}: {vp.layout.recipe.train.steps} steps of the layout "
          f"{_layout_text(vp.layout)} against {vp.reference_text}, {vp.precision} on {vp.device}")
    sections = (("exercised", vp.exercised or ["(nothing parallel: the recipe runs one process)"]),
                ("shrunk", vp.shrunk or ["(nothing)"]), ("set by verify", vp.changed),
                ("not compared", vp.not_compared))
    for title, lines in sections:
        if lines:
            print(f"{title}:")
            for line in lines:
                print(f"  - {line}")
    for q in outcome.quantities:
        _print_quantity(q)
    print(f"\n{'quantity':<40}{'max deviation':>15}{'tolerance':>11}  result")
    for q in outcome.quantities:
        print(f"{q.name:<40}{q.deviation:>15.2e}{q.tolerance:>11.0e}  {'pass' if q.passed else 'FAIL'}")
    failed = [q.name for q in outcome.quantities if not q.passed]
    timing = f"one process {outcome.reference_s:.1f} s, layout {outcome.layout_s:.1f} s"
    if failed:
        print(f"FAIL: the layout does not compute the same function: {', '.join(failed)} deviated ({timing})")
    else:
        print(f"PASS: the layout computes the same function as {vp.reference_text}, within {vp.precision}'s "
              f"tolerances ({timing})")


def _json(path: str, name: str, vp: VerifyPlan, outcome: Outcome | None, error: str | None) -> None:
    record = {"recipe": name, "steps": vp.layout.recipe.train.steps, "layout": _layout_text(vp.layout),
              "reference": vp.reference_text, "precision": vp.precision, "device": vp.device,
              "exercised": vp.exercised, "shrunk": vp.shrunk, "set_by_verify": vp.changed,
              "not_compared": vp.not_compared, "passed": outcome is not None and outcome.passed, "error": error}
    if outcome is not None:
        record["quantities"] = [{"name": q.name, "how": q.how, "max_deviation": q.deviation,
                                 "tolerance": q.tolerance, "worst": q.worst, "passed": q.passed}
                                for q in outcome.quantities]
        record["seconds"] = {"reference": outcome.reference_s, "layout": outcome.layout_s}
    Path(path).write_text(json.dumps(record, indent=1, default=str) + "\n")


def _verify(args: argparse.Namespace) -> int:
    try:
        path = find_recipe(args.recipe)
        from megazoo.recipes.verify.shrink import plan
        vp = plan(load_recipe(path, args.overrides, data_dir=args.data_dir), args.steps, args.precision,
                  args.device)
    except RecipeError as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        from megazoo.recipes.verify.precision import cuda_problem
        if problem := cuda_problem(max(vp.layout.world_size, vp.reference.world_size)):
            vp.discard()
            print(f"megazoo: error: {problem}", file=sys.stderr)
            return 2
    name = args.recipe
    try:
        from megazoo.recipes.verify.compare import run
        outcome = run(vp)
    except RuntimeError as err:  # a layout rank failed: the traceback names it
        from megazoo.parallel.collective_check import diagnose_mismatch
        diverged = diagnose_mismatch(err)  # ranks that called different collectives, named in one line
        print(f"megazoo verify {name}: FAIL: the layout did not run: {diverged or err}", file=sys.stderr)
        if args.json:
            _json(args.json, name, vp, None, str(err))
        return 1
    finally:
        vp.discard()  # the synthetic SFT rows of a fine-tuning recipe
    report(name, vp, outcome)
    if args.json:
        _json(args.json, name, vp, outcome, None)
    return 0 if outcome.passed else 1


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: it must be a positive number of steps")
    return value


def register(sub) -> None:
    p = sub.add_parser("verify", help="check that a recipe's parallel layout computes the same function as one "
                                      "process (shrunk, fp64, on this machine)")
    p.add_argument("recipe", help="recipe file or a shipped recipe's name (see `megazoo recipes`)")
    p.add_argument("--steps", type=_steps, default=3, help="training steps to compare (default 3)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe key before shrinking, e.g. --set zero.stage=3 (repeatable)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="as for megazoo train (verify itself trains on synthetic tokens)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the result as JSON to OUT")
    p.add_argument("--precision", choices=("fp64", "own"), default="fp64",
                   help="fp64 (default): against one process to 1e-10; own: in the recipe's precision against a "
                        "data-parallel reference, with that precision's tolerances")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: on this machine's GPUs (one per rank, NCCL), a truncated model at realistic widths, "
                        "the recipe's own precision")
    p.set_defaults(func=_verify)
