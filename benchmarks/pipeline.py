"""Pipeline bubble and activation memory, measured next to the theory.

For each (pp, schedule) the real Trainer runs a few steps on `pp` local gloo ranks (CPU) and every rank reports
its PipelineEngine statistics: compute time vs wall time (the bubble) and the most micro-batches whose
activations were alive at once. Theory: bubble (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved;
1F1B keeps at most p micro-batches of activations on the first stage, GPipe m.

    python benchmarks/pipeline.py [--m 8] [--steps 4] [--layers 8] [--json out.json]

On a 2-core CPU machine 4 ranks share 2 cores, so the measured bubble is inflated by time-slicing; the
activation counts are exact everywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazoo.workers.local import run_distributed  # noqa: E402
from megazoo.parallel.topology import Topology  # noqa: E402
from megazoo.recipes.config import Recipe, from_dict  # noqa: E402
from megazoo.recipes.resolve import resolve  # noqa: E402
from megazoo.recipes.training.trainer import Trainer  # noqa: E402


def _measure(table: dict, warmup: int):
    res = resolve(from_dict(Recipe, table))
    par = res.recipe.parallel
    trainer = Trainer(res, Topology.build(par.dp, par.tp, par.pp))
    for step in range(warmup):
        trainer.train_step(step)
    trainer.engine.stats.reset()
    for step in range(warmup, res.recipe.train.steps):
        trainer.train_step(step)
    stats = trainer.engine.stats
    act_bytes = res.recipe.train.micro_batch * res.recipe.train.seq_len * res.model.d_model * 4
    return {"pp_rank": trainer.topo.pp_rank, "bubble": stats.bubble, "live": stats.max_live_micro_batches,
            "activation_bytes": stats.max_live_micro_batches * act_bytes}


def theory(schedule: str, p: int, m: int, v: int) -> float:
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step (train.grad_accum)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for pp in (2, 4):
        for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
            table = {
                "model": {"preset": "gpt2-tiny", "n_layer": args.layers, "vocab_size": 512, "dropout": 0.0,
                          "attn_dropout": 0.0},
                "parallel": {"pp": pp, "schedule": schedule, "virtual_stages": v},
                "train": {"steps": args.steps + 1, "micro_batch": 4, "grad_accum": args.m, "seq_len": 64,
                          "precision": "fp32"},
                "data": {"source": "synthetic", "synthetic_tokens": 100_000},
                "logging": {"progress": False},
            }
            ranks = run_distributed(_measure, pp, table, 1)
            rows.append({"pp": pp, "schedule": schedule, "v": v, "m": args.m,
                         "bubble_measured": statistics.mean(r["bubble"] for r in ranks),
                         "bubble_theory": theory(schedule, pp, args.m, v),
                         "live_per_stage": [r["live"] for r in sorted(ranks, key=lambda r: r["pp_rank"])],
                         "activation_mb_first_stage": ranks[0]["activation_bytes"] / 2**20})
    print("| pp | schedule | v | m | bubble measured | bubble theory | live micro-batches per stage | "
          "first stage: live x b*s*d fp32 (MiB) |")
    print("|---:|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['pp']} | {r['schedule']} | {r['v']} | {r['m']} | {r['bubble_measured']:.3f} | "
              f"{r['bubble_theory']:.3f} | {r['live_per_stage']} | {r['activation_mb_first_stage']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
