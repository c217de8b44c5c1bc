"""ZeRO stages 0-3 against torch DDP and torch FSDP2: throughput, memory, and the largest GPT that trains.

    python -m benchmarks.zero                      # everything (about 15-20 minutes on 2 CPU cores)
    python -m benchmarks.zero --part throughput --quick
    python -m benchmarks.zero --part largest --json out.json

Part `throughput`: tokens/s and peak RSS per rank at dp=2 for megazoo's ZeRO stages 0-3 (ZeroEngine over
megazoo's GPT, the same build_zero objects the Trainer drives), torch DistributedDataParallel and torch FSDP2
(`fully_shard` per block, then the root), on the same model, weights (models.weights.init_weights) and data.
All fp32, AdamW, clip 1.0; `warmup` steps are run and not timed, then `steps` are timed.

Part `largest`: the largest GPT (by parameters, over a depth/width ladder) that completes 3 training steps with
4 ranks on this machine, for ZeRO stage 0 and stage 3. Attempts start at the largest rung whose estimate fits
the memory available and move up until one fails (or down until one succeeds).

Every configuration runs in fresh forked processes, because ru_maxrss is a process high-water mark. A forked
rank starts with its parent's resident pages (torch imported: the "idle rank" row). The parent kills every rank
when /proc/meminfo's MemAvailable falls under a floor, and each rank caps its address space (RLIMIT_AS), so an
attempt that does not fit fails cleanly instead of swapping or calling the OOM killer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from megazoo.models.config import ModelConfig, get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_parameter_, init_weights
from megazoo.parallel.topology import Topology, init_distributed
from megazoo.parallel.zero.api import ZeroEngine

GiB = 1 << 30
IMPLS = ("zero0", "zero1", "zero2", "zero3", "ddp", "fsdp2")
# (n_layer, d_model, n_head), ascending parameters: GPT-2 shapes and rungs between them, 64-wide heads.
LADDER = [(12, 768, 12), (12, 1024, 16), (16, 1024, 16), (20, 1024, 16), (24, 1024, 16), (16, 1280, 20),
          (20, 1280, 20), (24, 1280, 20), (28, 1280, 20), (32, 1280, 20), (36, 1280, 20), (28, 1600, 25),
          (32, 1600, 25), (36, 1600, 25), (40, 1600, 25), (48, 1600, 25), (40, 1920, 30), (48, 1920, 30),
          (48, 2048, 32), (44, 2304, 36)]


# ---- launching ranks ------------------------------------------------------------------------------------------
def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def use_mmap_for_large_allocations(threshold: int = 1 << 20) -> None:
    """glibc serves allocations under its (dynamic, up to 32 MB) mmap threshold from the heap, and a heap
    fragmented by ZeRO-3's gather/free churn keeps freed blocks resident: RSS then measures the allocator, not
    the model (gpt2-117m ZeRO-3: 3.3 GB peak vs 2.3 GB with this). Fixing the threshold returns every large
    buffer to the OS when it is freed. Applied alike to every configuration."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def _rank_main(rank, world, workdir, fn, args, as_bytes, mmap_large):
    torch.set_num_threads(1)  # ranks share the machine's cores
    if mmap_large:
        use_mmap_for_large_allocations()
    try:
        if as_bytes:  # cap the address space this rank may add: allocation fails before the machine runs out
            limit = _vm_size() + as_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        store = dist.FileStore(os.path.join(workdir, "store"), world)
        init_distributed(rank, world, store, device="cpu", timeout_s=1800)
        outcome = {"result": fn(*args)}
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        oom = isinstance(err, MemoryError) or "allocate" in str(err)
        outcome = {"error": ("out of memory: " if oom else "") + traceback.format_exc(limit=4)[-1500:]}
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    if "error" not in outcome:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # torch 2.13 + gloo may abort at interpreter exit: leave deterministically


def launch(fn, world: int, *args, timeout_s: float = 1800, floor_bytes: int = 2 * GiB, as_bytes: int = 0,
           mmap_large: bool = True):
    """Run fn(*args) on `world` fresh forked gloo ranks. Returns (per-rank results, None) or (None, why)."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="megazoo-bench-") as workdir:
        procs = [ctx.Process(target=_rank_main, args=(r, world, workdir, fn, args, as_bytes,
                                                                   mmap_large)) for r in range(world)]
        for p in procs:
            p.start()
        start, why = time.time(), None
        files = [os.path.join(workdir, f"rank{r}.json") for r in range(world)]
        while any(p.is_alive() for p in procs) and why is None:
            time.sleep(0.2)
            errors = [r for r, f in enumerate(files) if os.path.exists(f) and "error" in open(f).read(200)]
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and not os.path.exists(files[r])]
            if errors:
                time.sleep(0.5)
                why = json.load(open(files[errors[0]]))["error"].strip().splitlines()[-1][:200]
                why = f"rank {errors[0]}: {why}"
            elif dead:
                why = f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}; killed: out of memory?)"
            elif mem_available() < floor_bytes:
                why = f"memory guard: MemAvailable fell below {floor_bytes / GiB:.1f} GiB"
            elif time.time() - start > timeout_s:
                why = f"timeout after {timeout_s:.0f}s"
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        if why is None:
            outcomes = [json.load(open(f)) if os.path.exists(f) else {"error": "no result"} for f in files]
            bad = [o["error"] for o in outcomes if "error" in o]
            why = bad[0].strip().splitlines()[-1] if bad else None
        return (None, why) if why else ([o["result"] for o in outcomes], None)


# ---- one training configuration ------------------------------------------------------------------------------
def model_config(shape) -> ModelConfig:
    cfg = get_preset(shape) if isinstance(shape, str) else ModelConfig(
        f"gpt-{shape[0]}x{shape[1]}", n_layer=shape[0], d_model=shape[1], n_head=shape[2])
    return cfg.replace(dropout=0.0, attn_dropout=0.0)


def _decay_groups(model, weight_decay=0.1):
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _local_bytes(tensors) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def build(impl: str, cfg: ModelConfig, topo: Topology, seed: int = 0):
    """(model, train_step(x, y) -> loss, state_bytes() -> params + optimizer bytes, comm() -> bytes last step)."""
    if impl.startswith("zero"):
        stage = int(impl[-1])
        model = GPT(cfg, topo, device="meta" if stage == 3 else None)
        init_fn = None
        if stage == 3:  # materialised unit by unit, from the same per-name init as init_weights
            init_fn = lambda mod, name, t, spec: init_parameter_(model, mod, name, t, spec, seed)  # noqa: E731
        else:
            init_weights(model, seed)
        engine = ZeroEngine(model, topo, stage=stage, lr=1e-4, weight_decay=0.1, grad_clip=1.0, init_fn=init_fn)

        def train_step(x, y):
            engine.comm.reset()
            loss = model.loss(model(x), y)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        mem = lambda: (lambda m: m["params"] + m["optimizer"])(engine.memory_bytes())  # noqa: E731
        return model, train_step, mem, lambda: engine.comm.summary()["total_bytes"]
    model = GPT(cfg, topo)
    init_weights(model, seed)
    if impl == "ddp":
        # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets (no second copy).
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=topo.dp_group,
                                                            gradient_as_bucket_view=True)
    elif impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.h.values():
            fully_shard(block, mesh=topo.mesh["dp"])
        wrapped = fully_shard(model, mesh=topo.mesh["dp"])
    else:
        raise ValueError(f"unknown implementation {impl!r}; valid: {', '.join(IMPLS)}")
    opt = torch.optim.AdamW(_decay_groups(model), lr=1e-4)

    def train_step(x, y):
        loss = model.loss(wrapped(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def mem():
        states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        return _local_bytes(model.parameters()) + _local_bytes(states)

    return model, train_step, mem, lambda: None


def train_worker(impl: str, shape, seq: int, micro_batch: int, warmup: int, steps: int) -> dict:
    topo = Topology.build(dp=dist.get_world_size())
    cfg = model_config(shape)
    t0 = time.perf_counter()
    model, train_step, state_bytes, comm = build(impl, cfg, topo)
    built = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1000 + topo.dp_rank)
    losses, times, cpu = [], [], []
    for i in range(warmup + steps):
        batch = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=gen)
        dist.barrier()  # time the slowest rank's step
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(train_step(batch[:, :-1], batch[:, 1:]).item())
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
    # Medians: the 2 cores may be shared with other jobs. CPU seconds (all threads of this rank) are the
    # contention-robust cost; wall seconds the throughput actually seen.
    return {"step_s": sorted(times)[len(times) // 2], "cpu_s": sorted(cpu)[len(cpu) // 2], "losses": losses,
            "build_s": built,
            "peak_rss": peak_rss(), "state_bytes": state_bytes(), "comm_bytes": comm(),
            "params": sum(p.numel() for p in model.parameters()) if impl != "zero3" else cfg.num_parameters(),
            "tokens_per_step": topo.dp * micro_batch * seq}


def idle_worker() -> dict:
    return {"peak_rss": peak_rss()}


# ---- the two parts -------------------------------------------------------------------------------------------
def run_throughput(args) -> list[dict]:
    models = [("gpt2-tiny", 128, 8)] + ([] if args.quick else [("gpt2-117m", args.seq, args.micro_batch)])
    idle, _ = launch(idle_worker, 2, mmap_large=not args.default_malloc)
    rows = [{"model": "-", "impl": "idle rank", "peak_rss": [r["peak_rss"] for r in idle]}]
    for name, seq, mb in models:
        for impl in IMPLS:
            res, why = launch(train_worker, 2, impl, name, seq, mb, args.warmup, args.steps,
                              mmap_large=not args.default_malloc)
            row = {"model": name, "seq": seq, "micro_batch": mb, "impl": impl, "failed": why,
                   "loadavg_1m": os.getloadavg()[0]}
            if res:
                r0 = res[0]
                row.update(params=model_config(name).num_parameters(), step_s=r0["step_s"],
                           cpu_s=max(r["cpu_s"] for r in res),
                           tokens_per_s=r0["tokens_per_step"] / r0["step_s"], losses=r0["losses"],
                           peak_rss=[r["peak_rss"] for r in res], state_bytes=[r["state_bytes"] for r in res],
                           comm_bytes=r0["comm_bytes"], build_s=r0["build_s"])
            rows.append(row)
            done = f"FAILED {why}" if why else f"{row['tokens_per_s']:.0f} tok/s"
            print(f"  {name} {impl}: {done}", file=sys.stderr, flush=True)
    return rows


def estimate_rank_bytes(stage: int, n_params: int, cfg: ModelConfig, world: int) -> float:
    """Per-rank peak of one attempt, to choose where the search starts (the run itself decides). fp32 model
    states: stage 0 holds 4 (params) + 4 (grads) + 8 (Adam moments) bytes per parameter; stage 3 holds
    4 + 4 + 12 (fp32 master + moments) / world. Transients: the embedding's dense gradients (from the lookup and
    the tied head), its gradient bucket and reduce-scatter buffers (stage 3: ~4 root units; stage 0: ~2), and
    a few gathered blocks with their gradients."""
    root = cfg.padded_vocab(1) * cfg.d_model * 4
    block = (n_params - cfg.padded_vocab(1) * cfg.d_model) / cfg.n_layer * 4
    base = 0.4 * GiB  # forked rank with torch and a process group (~0.2 GB measured) + activations at seq <= 64
    if stage == 0:
        return 16 * n_params + 2 * root + base
    return 20 * n_params / world + 4 * root + 6 * block + base


def run_largest(args) -> dict:
    world, seq = 4, args.largest_seq
    budget = mem_available() - args.reserve_gib * GiB  # what the attempt's 4 ranks may use in all
    out = {"world": world, "seq": seq, "budget_bytes": budget, "attempts": [], "largest": {}}
    ladder = [(shape, model_config(shape).num_parameters()) for shape in LADDER]
    for stage in (0, 3):
        fits = [i for i, (s, n) in enumerate(ladder) if world * estimate_rank_bytes(stage, n, model_config(s),
                                                                                    world) <= budget]
        i = fits[-1] if fits else 0
        best, tried = None, set()
        while 0 <= i < len(ladder) and i not in tried:
            tried.add(i)
            shape, n = ladder[i]
            t0 = time.time()
            res, why = launch(train_worker, world, f"zero{stage}", shape, seq, 1, 0, 3,
                              as_bytes=int(budget / world + 2 * GiB), floor_bytes=int(args.reserve_gib * GiB),
                              timeout_s=args.timeout, mmap_large=not args.default_malloc)
            att = {"stage": stage, "shape": shape, "params": n, "ok": res is not None, "failed": why,
                   "wall_s": time.time() - t0, "peak_rss": [r["peak_rss"] for r in res] if res else None,
                   "step_s": res[0]["step_s"] if res else None}
            out["attempts"].append(att)
            print(f"  stage {stage} {shape} {n / 1e6:.0f}M: {'ok' if res else 'FAILED ' + why} "
                  f"({att['wall_s']:.0f}s)", file=sys.stderr, flush=True)
            if res:
                best = att
                i += 1  # fitted: try the next rung up
            elif best is None:
                i -= 1  # the first try failed: come down
            else:
                break
        out["largest"][stage] = best
    a, b = out["largest"].get(0), out["largest"].get(3)
    out["ratio"] = b["params"] / a["params"] if a and b else None
    return out


# ---- printing ------------------------------------------------------------------------------------------------
def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def print_throughput(rows) -> None:
    print("\n| model | params | impl | seq x micro-batch x dp | tokens/s | step s | CPU s/step/rank | load "
          "| peak RSS/rank GB (r0, r1) "
          "| params+optimizer states/rank GB (after the step) | comm/step/rank MB | last loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rss = ", ".join(_gb(x) for x in r.get("peak_rss") or [])
        if r["impl"] == "idle rank":
            print(f"| - | - | idle rank (torch imported, forked) | - | - | - | - | - | {rss} | - | - | - |")
        elif r["failed"]:
            print(f"| {r['model']} | - | {r['impl']} | - | FAILED: {r['failed']} | | | | | | | |")
        else:
            comm = "-" if r["comm_bytes"] is None else f"{r['comm_bytes'] / 1e6:.1f}"
            print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['impl']} | {r['seq']} x {r['micro_batch']} x 2 "
                  f"| {r['tokens_per_s']:.0f} | {r['step_s']:.2f} | {r['cpu_s']:.2f} | {r['loadavg_1m']:.1f} | {rss} "
                  f"| {_gb(max(r['state_bytes']))} | {comm} "
                  f"| {r['losses'][-1]:.6f} |")


def print_largest(out) -> None:
    print(f"\nLargest GPT completing 3 steps (fp32 AdamW, micro-batch 1 x seq {out['seq']}, {out['world']} ranks, "
          f"memory budget {out['budget_bytes'] / GiB:.1f} GiB):\n")
    print("| stage | n_layer x d_model (heads) | params | result | step s | peak RSS/rank GB (max) | wall s |")
    print("|---|---|---|---|---|---|---|")
    for a in out["attempts"]:
        L, d, h = a["shape"]
        result = "ok" if a["ok"] else f"failed: {a['failed']}"
        step = "-" if a["step_s"] is None else f"{a['step_s']:.1f}"
        rss = _gb(max(a["peak_rss"])) if a["peak_rss"] else "-"
        print(f"| {a['stage']} | {L} x {d} ({h}) | {a['params'] / 1e6:.0f}M | {result} | {step} | {rss} "
              f"| {a['wall_s']:.0f} |")
    print()
    for stage, best in out["largest"].items():
        print(f"largest at ZeRO stage {stage}: "
              + (f"{best['params'] / 1e6:.0f}M parameters ({best['shape'][0]} x {best['shape'][1]})" if best
                 else "none of the ladder"))
    if out["ratio"]:
        print(f"stage 3 / stage 0: {out['ratio']:.2f}x the parameters")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zero", description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "throughput", "largest"), default="all")
    p.add_argument("--quick", action="store_true", help="tiny model only, 1 warm-up + 2 timed steps")
    p.add_argument("--seq", type=int, default=256, help="sequence length for gpt2-117m")
    p.add_argument("--micro-batch", type=int, default=1, help="micro batch per rank for gpt2-117m")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--largest-seq", type=int, default=64)
    p.add_argument("--reserve-gib", type=float, default=4.0,
                   help="largest: memory left to the rest of the machine (other jobs may share it); the ranks are "
                        "killed when MemAvailable falls under it")
    p.add_argument("--default-malloc", action="store_true", help="keep glibc's dynamic mmap threshold")
    p.add_argument("--timeout", type=float, default=900, help="seconds per largest-model attempt")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.steps = 1, 2
    results = {"torch": torch.__version__, "cpus": os.cpu_count(),
               "mem_total_gib": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GiB}
    if args.part in ("all", "throughput"):
        results["throughput"] = run_throughput(args)
        print_throughput(results["throughput"])
    if args.part in ("all", "largest"):
        results["largest"] = run_largest(args)
        print_largest(results["largest"])
    print("\n" + json.dumps(results, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
