"""What the two hang keys cost per training step: parallel.flight_recorder (torch's ring of recent collectives)
and parallel.check_collectives (torch's DETAIL wrapper: a fingerprint all-gather before every collective).

    python -m benchmarks.hang_keys [--rounds 3] [--steps 6] [--layouts tp2 dp2] [--entries 2000]
    python -m benchmarks.hang_keys --micro [--calls 2000]   # microseconds per bare all-reduce (1 KiB)

Both keys act when the process groups are created, so every setting is its own job (forked gloo ranks through
workers/local.py's run_distributed, the real Trainer); the settings run interleaved, round after round, so a
change in the shared machine's load falls on all of them alike. Per job: seconds per step on rank 0 over
`--steps` steps after two warm-up steps, between barriers: wall clock, and the CPU time of the process (all its
threads: gloo's included), which a loaded shared machine disturbs far less than the wall clock. Printed: the
median per setting and its ratio to the median with both keys off, per layout.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer
from megazoo.workers.local import run_distributed

WARMUP = 2
TABLE = {  # a small GPT (4 blocks, d_model 256) in fp32: enough collectives per step, a short step on a CPU
    "model": {"preset": "gpt2-tiny", "n_layer": 4, "d_model": 256, "n_head": 4, "vocab_size": 1024,
              "dropout": 0.0, "attn_dropout": 0.0},
    "train": {"micro_batch": 4, "grad_accum": 2, "seq_len": 64, "precision": "fp32", "eval_batches": 1},
    "data": {"source": "synthetic", "synthetic_tokens": 200_000},
    "logging": {"progress": False},
    "checkpoint": {"at_end": False},
}
LAYOUTS = {  # (parallel, zero): tp = an all-reduce per block twice per micro-batch; dp = ZeRO-2 bucketed comms
    "tp2": ({"tp": 2}, {"stage": 0}),
    "dp2": ({"dp": 2}, {"stage": 2, "reduce_bucket_size": 200_000}),
}
SETTINGS = {"off": (0, False), "flight_recorder": (None, False), "check_collectives": (0, True),
            "both": (None, True)}


def worker(layout: str, steps: int) -> tuple[float, float]:
    table = copy.deepcopy(TABLE)
    parallel, zero = LAYOUTS[layout]
    table["parallel"], table["zero"] = dict(parallel), dict(zero)
    table["train"]["steps"] = WARMUP
    res = resolve(from_dict(Recipe, table))
    trainer = Trainer(res, Topology.build(parallel.get("dp", 1), parallel.get("tp", 1)))
    trainer.fit()  # the warm-up steps
    trainer.train_cfg = dataclasses.replace(trainer.train_cfg, steps=WARMUP + steps)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(start_step=WARMUP)
    dist.barrier()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def micro_worker(calls: int) -> tuple[float, float]:
    """Seconds per all-reduce of 256 floats (wall, CPU): the keys' cost per collective, without a model."""
    x = torch.ones(256)
    for _ in range(50):
        dist.all_reduce(x)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        dist.all_reduce(x)
    dist.barrier()
    return (time.perf_counter() - start) / calls, (time.process_time() - cpu) / calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--entries", type=int, default=2000, help="flight recorder ring size when on")
    p.add_argument("--micro", action="store_true", help="bare all-reduces instead of training steps")
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    if args.micro:
        args.layouts = ["allreduce-1KiB"]
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        for layout in args.layouts:
            for setting in args.settings:
                entries, check = SETTINGS[setting]
                work, work_args = (micro_worker, (args.calls,)) if args.micro else (worker, (layout, args.steps))
                wall, cpu = run_distributed(work, 2, *work_args, check_collectives=check,
                                            flight_recorder=args.entries if entries is None else entries)[0]
                times.setdefault((layout, setting), []).append((wall, cpu))
                unit = "call" if args.micro else "step"
                print(f"round {round_ + 1} {layout} {setting}: {wall * 1000:.3f} ms/{unit} wall, {cpu * 1000:.3f} "
                      f"ms/{unit} CPU", flush=True)
    what = (f"{args.calls} all-reduces of 256 floats per job; median ms per call" if args.micro else
            f"{args.steps} steps per job after {WARMUP} warm-up; median ms per step")
    print(f"\n2 gloo ranks, fp32, {what} (rank 0), {args.rounds} interleaved rounds, ratio to 'off' (flight "
          f"recorder ring {args.entries} entries)\n")
    print("| layout | measure | " + " | ".join(args.settings) + " |")
    print("|---|---|" + "---:|" * len(args.settings))
    for layout in args.layouts:
        for index, measure in enumerate(("wall", "CPU")):
            med = {s: statistics.median(t[index] for t in times[(layout, s)]) for s in args.settings}
            base = med.get("off")
            cells = [f"{med[s] * 1000:.{3 if args.micro else 1}f}" + (f" ({med[s] / base:.3f}x)" if base else "")
                     for s in args.settings]
            print(f"| {layout} | {measure} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
