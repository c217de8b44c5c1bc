"""Build gpt2-1.5b under ZeRO-3 on 4 real ranks without ever holding the full model on one of them.

    python -m benchmarks.zero3_construction                    # gpt2-1.5b, 4 ranks, dtype chosen to fit
    python -m benchmarks.zero3_construction --dtype fp32 --step

The model is built on the meta device and ZeroStage3 materialises it one unit (transformer block, then the root:
embeddings + final LayerNorm) at a time with models.weights.init_parameter_, keeping only this rank's 1/dp chunk
of each, exactly as the Trainer does for zero.stage = 3. Each rank reports its peak RSS (ru_maxrss: the
process high-water mark, so construction's transient full unit is included) against one full fp32 copy of the
model, and what it owns: parameter chunk bytes, fp32 master + gradient chunks (PartitionedOptimizer allocates
them at construction), then, with --step and if the estimate fits, the Adam moments of one training step.

Memory on a shared machine: the job is estimated first and refused when it would not fit in MemAvailable minus
--reserve-gib; while it runs, the parent kills every rank if MemAvailable falls under half the reserve.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from megazoo.recipes.reproduce.zero_bench import model_config
from megazoo.workers.guarded import GiB, launch, mem_available, peak_rss
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_parameter_
from megazoo.parallel.tensor import named_shards
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.build import build_zero

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BASELINE = 0.35 * GiB  # a forked rank with torch imported and a process group (measured ~0.2 GB) + slack


def estimate_rank_bytes(preset: str, dtype: str, world: int, step: bool) -> float:
    """Construction: this rank's parameter chunks (param dtype) + fp32 master (none in fp32: the chunk is its own
    master) and gradient chunks, plus one
    full unit materialised and copied into its flat bucket (the root, with the embedding, is the largest).
    A step adds the fp32 Adam moments (8 bytes per owned parameter) and the gathered units' gradients."""
    cfg = model_config(preset)
    n = cfg.num_parameters(vocab=cfg.padded_vocab(1))
    size = DTYPES[dtype].itemsize
    root = (cfg.padded_vocab(1) + cfg.n_positions) * cfg.d_model
    total = n * (size + 4 + (0 if dtype == "fp32" else 4)) / world + 2 * root * size + BASELINE
    return total + (8 * n / world + 3 * root * 4 if step else 0)


def worker(preset: str, dtype: str, seed: int, step: bool, seq: int) -> dict:
    topo = Topology.build(dp=dist.get_world_size())
    cfg = model_config(preset)
    rss_start = peak_rss()
    t0 = time.perf_counter()
    model = GPT(cfg, topo, device="meta", dtype=DTYPES[dtype])
    zero = build_zero(3, model, list(named_shards(model)), topo, lr=1e-4, weight_decay=0.1,
                      units=list(model.h.values()),
                      init_fn=lambda mod, name, t, spec: init_parameter_(model, mod, name, t, spec, seed))
    dist.barrier()
    out = {"rank": topo.rank, "construct_s": time.perf_counter() - t0, "rss_start": rss_start,
           "peak_rss_construct": peak_rss(), "full_numel": sum(p.numel() for p in model.parameters()),
           "owned_param_bytes": sum(s.numel() * s.element_size() for u in zero.units for s in u.shards),
           "owned_numel": sum(s.numel() for u in zero.units for s in u.shards),
           "memory_after_construct": zero.memory_bytes(),
           "meta_left": sum(p.is_meta for p in model.parameters())}
    if step:
        batch = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(topo.rank))
        t1 = time.perf_counter()
        zero.begin_micro_batch(last=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(batch[:, :-1])
        loss = model.loss(logits, batch[:, 1:])
        loss.backward()
        zero.finish_gradients()
        zero.clip_(zero.grad_norm(), 1.0)
        zero.step(1e-4)
        out.update(step_s=time.perf_counter() - t1, loss=loss.item(), peak_rss_step=peak_rss(),
                   memory_after_step=zero.memory_bytes())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zero3_construction", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-1.5b")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="parameter storage; auto: fp32 when it fits in memory, else bf16 (masters stay fp32)")
    p.add_argument("--step", action="store_true", help="also run one training step if the estimate fits")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reserve-gib", type=float, default=5.0, help="memory left to other jobs on the machine")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    budget = mem_available() - args.reserve_gib * GiB
    fits = lambda dt, st: args.world * estimate_rank_bytes(args.preset, dt, args.world, st) <= budget  # noqa
    dtype = args.dtype if args.dtype != "auto" else ("fp32" if fits("fp32", False) else "bf16")
    for dt in DTYPES:
        for st in (False, True):
            est = args.world * estimate_rank_bytes(args.preset, dt, args.world, st)
            print(f"estimate {dt} {'construct + 1 step' if st else 'construct':18s}: {est / GiB:5.1f} GiB for "
                  f"{args.world} ranks (budget {budget / GiB:.1f} GiB) -> {'fits' if est <= budget else 'no'}")
    if not fits(dtype, False):
        print(f"megazoo: {args.preset} at {dtype} does not fit in {budget / GiB:.1f} GiB; not started",
              file=sys.stderr)
        return 1
    step = args.step and fits(dtype, True)
    if args.step and not step:
        print(f"(--step skipped: one training step at {dtype} would need more than the budget)")
    print(f"running: {args.preset}, {args.world} ranks, ZeRO-3, parameters stored in {dtype}, step={step}",
          flush=True)
    t0 = time.time()
    results, why = launch(worker, args.world, args.preset, dtype, args.seed, step, args.seq,
                          floor_bytes=int(args.reserve_gib * GiB / 2), timeout_s=1800)
    if results is None:
        print(f"megazoo: the job failed: {why}", file=sys.stderr)
        return 1
    cfg = model_config(args.preset)
    full_fp32 = 4 * results[0]["full_numel"]
    print(f"\n{args.preset}: {cfg.num_parameters():,} parameters ({results[0]['full_numel']:,} with the padded "
          f"vocabulary); one full fp32 copy = {full_fp32 / 1e9:.2f} GB; wall {time.time() - t0:.0f}s\n")
    print("| rank | construct s | peak RSS construct GB | owned params (numel) | owned param bytes GB | fp32 masters "
          "(bf16 only) + Adam GB | owned grads GB | peak RSS / full fp32 copy |" + (" step s | peak RSS step GB |" if step else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if step else ""))
    for r in results:
        mem = r["memory_after_construct"]
        line = (f"| {r['rank']} | {r['construct_s']:.1f} | {r['peak_rss_construct'] / 1e9:.2f} | "
                f"{r['owned_numel']:,} | {r['owned_param_bytes'] / 1e9:.3f} | {mem['optimizer'] / 1e9:.3f} | "
                f"{mem['grads'] / 1e9:.3f} | {r['peak_rss_construct'] / full_fp32:.2f} |")
        if step:
            line += f" {r['step_s']:.1f} | {r['peak_rss_step'] / 1e9:.2f} |"
        print(line)
    assert all(r["meta_left"] == 0 for r in results), "some parameters were never materialised"
    print("\n" + json.dumps({"preset": args.preset, "dtype": dtype, "world": args.world, "full_fp32_bytes": full_fp32,
                             "ranks": results}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "dtype": dtype, "ranks": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
