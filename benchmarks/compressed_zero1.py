"""Optimizer-state bytes per rank of 1-bit Adam and 0/1 Adam at ZeRO stage 0 vs stage 1, on a real model.

    python -m benchmarks.compressed_zero1                         # gpt2-117m, dp = 2 (gloo, CPU)
    python -m benchmarks.compressed_zero1 --preset demo --dp 4

The real Trainer (fp32, synthetic tokens, micro_batch 1, seq_len 64) takes a few steps of each optimizer at each
stage; after every step it reads the ZeroOptimizer's own count, memory_bytes()["optimizer"] (moments, error
buffers, 0/1 Adam's work buffer and anchor, 1-bit Adam's packed momentum), on dp rank 0. The schedule is short so
every phase is seen: warm-up (AdamW), compressed, and for 0/1 Adam its local phase (where stage 1 holds what
stage 0 holds, see parallel/compressed/zero1.py). Also the bytes each rank sent per step (comm_bytes): stage 1
adds an all-gather of the updated parameters. Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json

from megazoo.parallel.compressed.schedule import CompressionSettings, Schedule
from megazoo.parallel.topology import Topology
from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.config import load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer
from megazoo.workers.local import run_distributed

OPTIMIZERS = {
    "onebit_adam": ["optimizer.name='onebit_adam'", "optimizer.freeze_step=2"],
    "zero_one_adam": ["optimizer.name='zero_one_adam'", "optimizer.freeze_step=2", "optimizer.var_freeze_step=4",
                      "optimizer.local_step_scaler=1", "optimizer.local_step_clipper=2"],
}
STEPS = 6


def _measure(recipes: dict) -> dict:
    out = {}
    for key, res in recipes.items():
        trainer = Trainer(res, Topology.build(res.recipe.parallel.dp))
        rows = []
        for step in range(STEPS):
            metrics = trainer.train_step(step)
            rows.append({"optimizer_bytes": trainer.zero.memory_bytes()["optimizer"],
                         "comm_bytes": metrics["comm_bytes"]})
        out[key] = rows
        del trainer
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-117m", help="the recipe (recipes/NAME.toml)")
    parser.add_argument("--dp", type=int, default=2, choices=(2, 4))
    args = parser.parse_args(argv)
    recipes = {}
    for name, keys in OPTIMIZERS.items():
        for stage in (0, 1):
            recipes[f"{name}/stage{stage}"] = resolve(load_recipe(find_recipe(args.preset), [
                f"parallel.dp={args.dp}", f"zero.stage={stage}", "zero.offload='none'", "train.micro_batch=1",
                "train.grad_accum=1", "train.seq_len=64", f"train.global_batch={args.dp}", f"train.steps={STEPS}",
                "train.precision='fp32'", "data.source='synthetic'", "data.paths=[]", "data.tokenizer=''",
                "data.synthetic_tokens=20000", "logging.progress=false", "sample.tokens=0", *keys]))
    result = run_distributed(_measure, args.dp, recipes, timeout_s=3000)[0]
    print(json.dumps({"preset": args.preset, "dp": args.dp, "per_step": result}, indent=1))
    print("| optimizer | step | kind | stage 0 bytes | stage 1 bytes | stage 0 / stage 1 | sent stage 0 | sent stage 1 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in OPTIMIZERS:
        res = recipes[f"{name}/stage0"]
        o = res.recipe.optimizer
        schedule = Schedule(CompressionSettings(o.name, o.freeze_step, o.var_freeze_step, o.var_update_scaler,
                                                o.local_step_scaler, o.local_step_clipper, last_step=STEPS - 1))
        for step in range(STEPS):
            s0, s1 = result[f"{name}/stage0"][step], result[f"{name}/stage1"][step]
            print(f"| {name} | {step} | {schedule.kind(step)} | {s0['optimizer_bytes'] / 2**20:.1f} MiB | "
                  f"{s1['optimizer_bytes'] / 2**20:.1f} MiB | {s0['optimizer_bytes'] / s1['optimizer_bytes']:.2f}x | "
                  f"{s0['comm_bytes'] / 2**20:.1f} MiB | {s1['comm_bytes'] / 2**20:.1f} MiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
