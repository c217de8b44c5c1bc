"""Seconds per checkpoint save with and without checkpoint.verify_on_save (the re-read), gpt2-117m shapes.

    python -m benchmarks.checkpoint_verify                 # dp = 1, 3 saves each way
    python -m benchmarks.checkpoint_verify --dp 2 --saves 2

The real Trainer on the gpt2-117m recipe's model (124M parameters, fp32, ZeRO stage as the recipe: 0) takes one
step on synthetic tokens (so the Adam moments exist), then saves alternately with verification off and on; every
save is timed between two barriers, so the figure is the slowest rank's. What a rank writes: parameters, Adam
moments and step (16 bytes per parameter it owns, less the tp/dp replicas it skips). The re-read drops the file's
cached pages first (posix_fadvise), so on Linux it reads from the storage; prints JSON, then a markdown row.
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

from megazoo.parallel.checkpoint import io as ckpt_io
from megazoo.parallel.topology import Topology
from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.config import load_recipe
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer
from megazoo.workers.local import run_distributed


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _timed_read_back(spent: list[float]):
    """ckpt_io's read-back check, timed: the verification's own seconds, apart from the save's noise."""
    real = ckpt_io.read_back_problem

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[-1] += time.perf_counter() - start
    return timed


def _measure(res, saves: int) -> dict:
    par = res.recipe.parallel
    read_back: list[float] = []
    ckpt_io.read_back_problem = _timed_read_back(read_back)  # this process only (a forked rank, or the CLI)
    topo = Topology.build(par.dp) if par.dp > 1 else Topology.solo()
    trainer = Trainer(res, topo)
    trainer.train_step(0)
    variants = {flag: dataclasses.replace(res, recipe=dataclasses.replace(res.recipe, checkpoint=dataclasses.replace(
        res.recipe.checkpoint, verify_on_save=flag))) for flag in (False, True)}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    step = 1
    for i in range(saves):
        for flag in ((False, True) if i % 2 == 0 else (True, False)):  # alternate: neither always goes first
            trainer.res = variants[flag]
            read_back.append(0.0)
            _barrier()
            start = time.perf_counter()
            path = trainer.save_checkpoint(step)
            _barrier()
            seconds[flag].append(time.perf_counter() - start)
            if not flag:
                read_back.pop()
            step += 1
    size = sum(f.stat().st_size for f in path.iterdir() if f.name.startswith("rank"))
    return {"off": seconds[False], "on": seconds[True], "bytes_all_ranks": size, "read_back": read_back}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1, choices=(1, 2))
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megazoo-ckpt-verify-", dir=args.dir) as tmp:
        recipe = load_recipe(find_recipe("gpt2-117m"), [
            f"parallel.dp={args.dp}", "train.micro_batch=1", "train.grad_accum=1", "train.seq_len=64",
            "train.global_batch=" + str(args.dp), "train.precision='fp32'", "data.source='synthetic'",
            "data.paths=[]", "data.tokenizer=''", "data.synthetic_tokens=20000", f"run.dir='{tmp}'",
            "checkpoint.keep=2", "logging.progress=false", "sample.tokens=0"])
        res = resolve(recipe)
        result = (_measure(res, args.saves) if args.dp == 1
                  else run_distributed(_measure, args.dp, res, args.saves, timeout_s=1800)[0])
    off, on = statistics.median(result["off"]), statistics.median(result["on"])
    gib = result["bytes_all_ranks"] / 2**30
    record = {"model": "gpt2-117m", "dp": args.dp, "saves_each": args.saves, "checkpoint_gib": round(gib, 3),
              "seconds_per_save_verify_off": off, "seconds_per_save_verify_on": on,
              "verify_cost_s": on - off, "verify_cost_fraction": (on - off) / off,
              "read_back_s_per_save": statistics.median(result["read_back"]), "all_off": result["off"],
              "all_on": result["on"], "where": str(Path(args.dir or tempfile.gettempdir()).resolve())}
    print(json.dumps(record, indent=1))
    rb = record["read_back_s_per_save"]
    print(f"| gpt2-117m dp={args.dp} | {gib:.2f} GiB | {off:.2f} s | {on:.2f} s | {on - off:+.2f} s | {rb:.2f} s "
          f"({100 * rb / off:.0f}% of a save) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
