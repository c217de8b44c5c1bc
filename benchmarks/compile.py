"""train.compile = "blocks" against eager on this machine: tokens/s of the training step, interleaved, and the
compile time apart.

    python -m benchmarks.compile                          # gpt2-tiny x 4 layers, seq 128, micro-batch 8, fp32
    python -m benchmarks.compile --d-model 256 --seq-len 256 --rounds 5 --json out.json

One process builds two Trainers of the same recipe (solo, ZeRO-1, the same seed and data): eager and
compiled (Inductor: every block's forward and backward, recipes/training/model_setup.compile_blocks). The
compiled trainer's first steps pay the compile (Dynamo capture + AOTAutograd + Inductor's C++ code generation
and g++; counted until a step runs within 1.5x of the eager step time, reported as compile seconds); then
`--rounds` rounds each time `--steps` eager steps and `--steps` compiled steps, alternating which goes first,
so that load changes on a shared machine hit both alike. Reported: tokens/s per round and their medians, the
compiled/eager ratio, the losses of both (equal within fp32 rounding: Inductor reorders reductions), and the
load average before and after (os.getloadavg: other processes on the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megazoo.parallel.topology import Topology  # noqa: E402
from megazoo.recipes.config import Recipe, from_dict  # noqa: E402
from megazoo.recipes.resolve import resolve  # noqa: E402
from megazoo.recipes.training.trainer import Trainer  # noqa: E402


def recipe(args, compile_mode: str):
    return resolve(from_dict(Recipe, {
        "model": {"preset": "gpt2-tiny", "n_layer": args.layers, "d_model": args.d_model, "n_head": args.heads,
                  "vocab_size": 512, "dropout": 0.0, "attn_dropout": 0.0, "n_positions": max(args.seq_len, 128)},
        "parallel": {"dp": 1, "tp": 1, "pp": 1},
        "zero": {"stage": 1},
        "train": {"steps": 10_000, "micro_batch": args.micro_batch, "grad_accum": 1, "seq_len": args.seq_len,
                  "precision": args.precision, "compile": compile_mode, "seed": 3},
        "data": {"source": "synthetic", "synthetic_tokens": 200_000},
        "logging": {"progress": False},
        "checkpoint": {"at_end": False},
    }))


def cpu_seconds() -> float:
    """This process's CPU time and that of its finished children (g++ runs as one per compiled kernel file)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed_steps(trainer, first: int, count: int) -> tuple[float, list[float]]:
    start = time.perf_counter()
    losses = [trainer.train_step(first + i)["loss"] for i in range(count)]
    return time.perf_counter() - start, losses


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp64", "bf16"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per timed run")
    p.add_argument("--mode", default="blocks", choices=("blocks", "blocks:aot_eager"))
    p.add_argument("--warm-cache", action="store_true",
                   help="let Inductor reuse its on-disk caches (default: off, every run compiles cold)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    # Inductor compiles in this process (no worker pool), so that the compile's CPU time can be counted.
    torch._inductor.config.compile_threads = 1
    torch._inductor.config.force_disable_caches = not args.warm_cache
    load_before = os.getloadavg()
    tokens = args.micro_batch * args.seq_len
    eager = Trainer(recipe(args, "none"), Topology.solo())
    compiled = Trainer(recipe(args, args.mode), Topology.solo())

    eager_s, eager_losses = timed_steps(eager, 0, 2)  # eager warm-up: two steps, then one to time
    one_eager, more = timed_steps(eager, 2, 1)
    eager_losses += more
    compile_start, compile_cpu = time.perf_counter(), cpu_seconds()
    compiled_losses, step = [], 0
    while step < 10:  # compile: until a compiled step runs within 1.5x of an eager one (at most 10)
        seconds, loss = timed_steps(compiled, step, 1)
        compiled_losses += loss
        step += 1
        if step >= 3 and seconds < 1.5 * one_eager:
            break
    compile_s, compile_cpu_s = time.perf_counter() - compile_start, cpu_seconds() - compile_cpu
    settle_steps = step
    # the same steps on both: catch the eager trainer up with the compiled one's step count
    more_s, more = timed_steps(eager, 3, step - 3)
    eager_losses += more
    rounds = []
    for r in range(args.rounds):
        order = [("eager", eager), ("compiled", compiled)][:: 1 if r % 2 == 0 else -1]
        row = {}
        for name, trainer in order:
            seconds, losses = timed_steps(trainer, step, args.steps)
            row[name] = tokens * args.steps / seconds
            (eager_losses if name == "eager" else compiled_losses).extend(losses)
        step += args.steps
        rounds.append(row)
        print(f"round {r}: eager {row['eager']:,.0f} tok/s, compiled {row['compiled']:,.0f} tok/s, "
              f"ratio {row['compiled'] / row['eager']:.3f}", flush=True)
    med = {k: statistics.median(row[k] for row in rounds) for k in ("eager", "compiled")}
    diff = max(abs(a - b) for a, b in zip(eager_losses, compiled_losses))
    out = {"shape": {k: getattr(args, k) for k in ("layers", "d_model", "heads", "seq_len", "micro_batch",
                                                   "precision", "mode")},
           "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "compile_s_wall": compile_s, "compile_s_cpu": compile_cpu_s, "compile_steps": settle_steps,
           "rounds": rounds, "median_tokens_per_s": med, "ratio": med["compiled"] / med["eager"],
           "max_loss_diff": diff, "steps_compared": len(eager_losses),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    print(f"compile: {compile_s:.1f} s wall, {compile_cpu_s:.1f} s CPU ({settle_steps} steps until settled)")
    print(f"median tokens/s: eager {med['eager']:,.0f}, compiled {med['compiled']:,.0f}, "
          f"ratio {out['ratio']:.3f}")
    print(f"losses over {len(eager_losses)} steps: max |eager - compiled| = {diff:.3g}")
    print(f"load average before {load_before}, after {out['loadavg_after']} on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
