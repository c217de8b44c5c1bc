"""Node-aware ZeRO on this machine: dp 4 as 2 "nodes" x 2 (gloo, forked ranks), flat ZeRO vs HSDP vs hpZ.

    python -m benchmarks.hsdp_links [--steps 4] [--json out.json]

For each layout: the largest loss and parameter difference from one fp64 process (the parity the tests hold to
1e-10), and the bytes each rank sent in the last step per link class (intra-node / inter-node, counted by
parallel/collectives.CommLedger) beside recipes/planner/links.py's formula for the same buckets. Prints a
markdown table and, with --json, the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny parity recipe

from recipe_helpers import tiny_resolved  # noqa: E402

from megazoo.parallel.topology import Topology  # noqa: E402
from megazoo.recipes.planner.links import link_volume  # noqa: E402
from megazoo.recipes.training.trainer import Trainer  # noqa: E402
from megazoo.workers.local import run_distributed  # noqa: E402

LAYOUTS = {  # name -> (zero section, train section, planner sharding)
    "flat ZeRO-1": ({"stage": 1}, {"micro_batch": 2}, "flat"),
    "flat ZeRO-3": ({"stage": 3}, {"micro_batch": 2}, "flat"),
    "HSDP ZeRO-1": ({"stage": 1, "shard_group": "node"}, {"micro_batch": 2}, "hsdp"),
    "HSDP ZeRO-2": ({"stage": 2, "shard_group": "node"}, {"micro_batch": 2}, "hsdp"),
    "HSDP ZeRO-3": ({"stage": 3, "shard_group": "node"}, {"micro_batch": 2}, "hsdp"),
    "hpZ ZeRO-3": ({"stage": 3, "hpz": True}, {"micro_batch": 2}, "hpz"),
    # qwZ: not exact by design (int8 weights in forward/backward); the planned bytes are the unquantized ones
    "flat ZeRO-3 + qwZ": ({"stage": 3, "quantized_weights": True}, {"micro_batch": 2}, "flat"),
    "hpZ ZeRO-3 + qwZ": ({"stage": 3, "hpz": True, "quantized_weights": True}, {"micro_batch": 2}, "hpz"),
}


def _train(res):
    trainer = Trainer(res, Topology.build(4, node_size=2)) if res.world_size > 1 else Trainer(res, Topology.solo())
    result = trainer.fit()
    out = {"losses": result.losses, "params": {k: v.clone() for k, v in trainer.full_state_dict().items()}}
    if res.world_size > 1:
        trainer.train_step(res.recipe.train.steps)  # one more step: the ledger then holds exactly its traffic
        zero = trainer.zero
        out["links"] = dict(zero.comm.link_bytes)
        units = getattr(zero, "units", None)
        out["psi"] = sum(b.numel for b in zero.buckets)
        out["root"] = sum(b.numel for b in units[-1].buckets) if units else 0
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ref = _train(tiny_resolved(train={"micro_batch": 8, "steps": args.steps}))
    rows = []
    print("| layout | max loss diff vs 1 process | max param diff | intra-node B/step | planned | "
          "inter-node B/step | planned |")
    print("|:---|---:|---:|---:|---:|---:|---:|")
    for name, (zero, train, sharding) in LAYOUTS.items():
        res = tiny_resolved(parallel={"dp": 4, "node_size": 2}, zero=zero, train={**train, "steps": args.steps})
        got = run_distributed(_train, 4, res)[0]
        loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        param = max((got["params"][k] - v).abs().max().item() for k, v in ref["params"].items())
        plan = link_volume(got["psi"], 4, 2, zero["stage"], sharding, root=got["root"])
        # + the gradient norm's all-reduce of 2 fp64 numbers over the shard group (flat / hpZ: dp, HSDP: node)
        norm = 2 * 8 * (3 / 4 if sharding != "hsdp" else 1 / 2) * 2
        planned = {"intra": plan.intra * 8 + (norm if sharding == "hsdp" else 0),
                   "inter": plan.inter * 8 + (norm if sharding != "hsdp" else 0)}
        row = {"layout": name, "loss_diff": loss, "param_diff": param, "links": got["links"], "planned": planned}
        rows.append(row)
        print(f"| {name} | {loss:.1e} | {param:.1e} | {got['links'].get('intra', 0):,.0f} | {planned['intra']:,.0f} "
              f"| {got['links'].get('inter', 0):,.0f} | {planned['inter']:,.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
