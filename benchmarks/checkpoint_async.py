"""The training stall per checkpoint save, sync vs checkpoint.async_save, gpt2-117m shapes, one interleaved run.

    python -m benchmarks.checkpoint_async                  # dp = 2 (gloo, CPU), 3 saves each way
    python -m benchmarks.checkpoint_async --dp 1 --saves 2 --steps-between 2

The real Trainer on the gpt2-117m recipe's model (124M parameters, fp32, ZeRO stage 1 so each dp rank writes its
share of the Adam moments) takes one step on synthetic tokens, then saves alternately sync and async (the order
flips every round so neither always goes first), with `--steps-between` training steps after each save. Per save:

  stall      seconds the training loop is blocked by the save, between two barriers (the slowest rank's):
             sync: the whole save (serialise, fsync, sha256, verify-on-save re-read, publish);
             async: the save() call (the copy to host memory + starting the writer) plus whatever the loop
             still waits for at the next save (wait(), timed after the steps in between).
  step_s     seconds per training step in between: with an async save the writer shares the CPU with them.

Prints JSON, then a markdown row with the ratios (sync stall / async stall, step time with / without a writer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from megazoo.parallel.topology import Topology
from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.config import load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.trainer import Trainer
from megazoo.workers.local import run_distributed


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _timed(fn) -> float:
    _barrier()
    start = time.perf_counter()
    fn()
    _barrier()
    return time.perf_counter() - start


def _measure(res, saves: int, steps_between: int) -> dict:
    par = res.recipe.parallel
    topo = Topology.build(par.dp) if par.dp > 1 else Topology.solo()
    trainer = Trainer(res, topo)
    trainer.train_step(0)
    variants = {flag: dataclasses.replace(res, recipe=dataclasses.replace(res.recipe, checkpoint=dataclasses.replace(
        res.recipe.checkpoint, async_save=flag))) for flag in (False, True)}
    out = {mode: {"returned_s": [], "waited_s": [], "stall_s": [], "step_s": []} for mode in ("sync", "async")}
    step = 1
    for i in range(saves):
        for flag in ((False, True) if i % 2 == 0 else (True, False)):
            record = out["async" if flag else "sync"]
            trainer.res = variants[flag]
            returned = _timed(lambda: trainer.save_checkpoint(step))
            for _ in range(steps_between):
                record["step_s"].append(_timed(lambda: trainer.train_step(step)))
                step += 1
            waited = _timed(lambda: checkpointing.wait_for_save(trainer))  # sync: nothing in flight (~0)
            record["returned_s"].append(returned)
            record["waited_s"].append(waited)
            record["stall_s"].append(returned + waited)
            step += 1
    root = Path(res.recipe.run.dir) / "checkpoints"
    latest = root / (root / "latest").read_text()
    out["checkpoint_bytes"] = sum(f.stat().st_size for f in latest.iterdir() if f.name.startswith("rank"))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2, choices=(1, 2))
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=2)
    parser.add_argument("--preset", default="gpt2-117m", help="the recipe (recipes/NAME.toml) to measure")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megazoo-ckpt-async-", dir=args.dir) as tmp:
        recipe = load_recipe(find_recipe(args.preset), [
            f"parallel.dp={args.dp}", "zero.stage=1", "train.micro_batch=1", "train.grad_accum=1",
            "train.seq_len=64", "train.global_batch=" + str(args.dp), "train.precision='fp32'",
            "data.source='synthetic'", "data.paths=[]", "data.tokenizer=''", "data.synthetic_tokens=20000",
            f"run.dir='{tmp}'", "checkpoint.keep=2", "logging.progress=false", "sample.tokens=0"])
        res = resolve(recipe)
        result = (_measure(res, args.saves, args.steps_between) if args.dp == 1
                  else run_distributed(_measure, args.dp, res, args.saves, args.steps_between, timeout_s=3000)[0])
    med = {mode: {k: statistics.median(v) for k, v in result[mode].items()} for mode in ("sync", "async")}
    gib = result["checkpoint_bytes"] / 2**30
    stall_ratio = med["sync"]["stall_s"] / med["async"]["stall_s"]
    step_ratio = med["async"]["step_s"] / med["sync"]["step_s"]
    record = {"model": args.preset, "dp": args.dp, "zero_stage": 1, "saves_each": args.saves,
              "steps_between": args.steps_between, "checkpoint_gib": round(gib, 3), "median": med,
              "sync_over_async_stall": stall_ratio, "step_time_async_over_sync": step_ratio,
              "all": {mode: result[mode] for mode in ("sync", "async")},
              "where": str(Path(args.dir or tempfile.gettempdir()).resolve())}
    print(json.dumps(record, indent=1))
    print("| model | dp | checkpoint | sync stall | async stall (returned + waited) | sync / async | step with "
          "writer / without |")
    print(f"| {args.preset} | {args.dp} | {gib:.2f} GiB | {med['sync']['stall_s']:.2f} s | "
          f"{med['async']['stall_s']:.2f} s ({med['async']['returned_s']:.2f} + {med['async']['waited_s']:.2f}) | "
          f"{stall_ratio:.1f}x | {step_ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
