"""ZeRO's cross-node bytes at full size: the dry run (the real training step as rank 0 of the recipe's world, on
fake tensors) of a recipe under flat ZeRO, HSDP, hpZ and ZeRO++'s quantized collectives (qwZ, qgZ), beside
recipes/planner/links.py's formula (link_bytes).

    python -m benchmarks.dry_run_links [--recipe tnlg-17b] [--node-size 8] [--stages 1,3] [--layouts ...]
                                       [--json out.json]

tnlg-17b is dp 64 x tp 4 = 256 GPUs; with 8 GPUs per node (32 nodes) each node holds 2 dp ranks of every tp
position. Prints one markdown row per layout: measured intra-/inter-node GB per rank per step, the planned ones,
the measured difference from the plan and the cross-node bytes saved against flat ZeRO at that stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megazoo.recipes.dry_run.run import load, roles, run_role
from megazoo.recipes.planner.links import link_bytes
from megazoo.recipes.planner.shards import shard_parameters

LAYOUTS = {1: ("flat", "hsdp", "qgz-int4"), 2: ("flat", "hsdp", "qgz-int4"),
           3: ("flat", "hsdp", "hpz", "qwz", "qgz-int8", "qgz-int4", "hpz+qwz+qgz-int4")}
ZERO = {"flat": [], "hsdp": ["zero.shard_group=node"], "hpz": ["zero.hpz=true"],  # ZeRO++ below
        "qwz": ["zero.quantized_weights=true"], "qgz-int8": ["zero.quantized_gradients=int8"],
        "qgz-int4": ["zero.quantized_gradients=int4"],
        "hpz+qwz+qgz-int4": ["zero.hpz=true", "zero.quantized_weights=true", "zero.quantized_gradients=int4"]}
SHARDING = {"hsdp": "hsdp", "hpz": "hpz", "hpz+qwz+qgz-int4": "hpz"}  # the rest: flat


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="tnlg-17b")
    parser.add_argument("--node-size", type=int, default=8)
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--layouts", default="", help="comma-separated subset of: " + ", ".join(ZERO))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    wanted = [x for x in args.layouts.split(",") if x]
    if any(x not in ZERO for x in wanted):
        parser.error(f"--layouts {args.layouts!r} is invalid; valid: a comma-separated subset of {', '.join(ZERO)}")
    rows = []
    print("| stage | layout | intra GB (dry run) | intra GB (planner) | inter GB (dry run) | inter GB (planner) | "
          "inter diff | inter saved vs flat (dry run) | dry run s |")
    print("|---:|:---|---:|---:|---:|---:|---:|---:|---:|")
    for stage in (int(s) for s in args.stages.split(",")):
        flat_inter = None
        for name in LAYOUTS[stage]:
            if wanted and name not in wanted and name != "flat":
                continue
            sharding = SHARDING.get(name, "flat")
            sets = [f"parallel.node_size={args.node_size}", f"zero.stage={stage}", *ZERO[name]]
            res = load(args.recipe, sets)
            par = res.recipe.parallel
            start = time.perf_counter()
            got = run_role(res, roles(res)[0]).measured.link_bytes
            seconds = time.perf_counter() - start
            shard = shard_parameters(res.model, par.tp).stages[0]  # one tp rank's parameters (padded vocabulary)
            psi = shard.numel
            root = sum(t.numel for t in shard.tensors if not t.name.startswith("h.")) if stage == 3 else 0
            per_node = min(par.dp, args.node_size // par.tp)
            element = 2 if res.recipe.train.precision in ("bf16", "fp16") else 4
            zero = res.recipe.zero
            plan = link_bytes(psi, par.dp, per_node, stage, sharding, grad_accum=res.recipe.train.grad_accum,
                              root=root, element_bytes=element, quantized_weights=zero.quantized_weights,
                              quantized_gradients=zero.quantized_gradients)
            want = {"intra": plan.intra, "inter": plan.inter}
            diff = (got.get("inter", 0.0) - want["inter"]) / want["inter"] if want["inter"] else 0.0
            flat_inter = flat_inter if flat_inter is not None else got.get("inter", 0.0)
            saved = 1 - got.get("inter", 0.0) / flat_inter if flat_inter else 0.0
            rows.append({"stage": stage, "layout": name, "sharding": sharding, "measured": got, "planned": want,
                         "seconds": seconds})
            print(f"| {stage} | {name} | {got.get('intra', 0) / 1e9:.3f} | {want['intra'] / 1e9:.3f} | "
                  f"{got.get('inter', 0) / 1e9:.3f} | {want['inter'] / 1e9:.3f} | {diff:+.2%} | {saved:.0%} | "
                  f"{seconds:.0f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
