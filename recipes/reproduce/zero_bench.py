"""The ZeRO measurements: stages 0-3 against torch DDP and torch FSDP2 (throughput, memory) and the largest GPT
that trains. benchmarks/zero.py prints them as tables; `megazoo reproduce zero-scale` uses the same ladder,
worker and launcher, so an installed megazoo measures without a checkout.

Part `throughput`: tokens/s and peak RSS per rank at dp=2 for megazoo's ZeRO stages 0-3 (ZeroEngine over
megazoo's GPT, the same build_zero objects the Trainer drives), torch DistributedDataParallel and torch FSDP2
(`fully_shard` per block, then the root), on the same model, weights (models.weights.init_weights) and data:
the memory-bound model (8 x 1024, 16 heads, vocab 8192, 109M params, micro-batch 1 x seq 128) and gpt2-117m.
All fp32, AdamW, clip 1.0; `warmup` steps are run and not timed, then `steps` steps are timed as ONE window
between two barriers (a barrier after every step would hide what overlaps across steps: stage 1-2's and the
next forward's all-gathers). Configurations run in `rounds` interleaved rounds (alternating order); a row
reports the median step time over rounds, and its "vs DDP" / "vs FSDP2" ratios are the medians of the
per-round ratios (each taken against the reference run in the same round, so a load change between rounds
cancels); peak RSS is the maximum over rounds. Each step is split
into phases (mean seconds per timed step): forward, backward, reduce wait (finish_gradients; DDP reduces
inside its backward), grad norm, optimizer (the rest of the step: clip, AdamW, stages 1-2's all-gather) and
all-gather wait (the ZeRO objects' own host-clock accumulator `wait_s`, where present: stages 1-2 inside the
optimizer phase, stage 3 inside forward and backward).

Part `largest`: the largest GPT (by parameters, over a depth/width ladder) that completes 3 training steps with
4 ranks on this machine, for ZeRO stage 0 and stage 3. Attempts start at the largest rung whose estimate fits
the memory available and move up until one fails (or down until one succeeds).

Ranks are fresh forked processes with a memory guard (workers/guarded.py).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from megazoo.models.config import ModelConfig
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_parameter_, init_weights
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.api import ZeroEngine
from megazoo.workers.guarded import GiB, launch, mem_available, peak_rss

PHASES = ("forward", "backward", "reduce wait", "grad norm", "optimizer", "all-gather wait")
MEMORY_BOUND = ("gpt-8x1024", dict(n_layer=8, d_model=1024, n_head=16, vocab_size=8192, n_positions=128))
IMPLS = ("zero0", "zero1", "zero2", "zero3", "ddp", "fsdp2")
# (n_layer, d_model, n_head): GPT-2 shapes and rungs between them, 64-wide heads (run_largest sorts them by
# parameter count); about 4-10% apart where stage 0 and stage 3 end on this machine, so the ratio of the two is
# not the ladder's step.
LADDER = [(12, 768, 12), (12, 1024, 16), (14, 1024, 16), (16, 1024, 16), (18, 1024, 16), (20, 1024, 16),
          (24, 1024, 16), (16, 1280, 20), (20, 1280, 20), (24, 1280, 20), (28, 1280, 20), (32, 1280, 20),
          (36, 1280, 20), (40, 1280, 20), (42, 1280, 20), (44, 1280, 20), (46, 1280, 20), (48, 1280, 20),
          (28, 1600, 25), (32, 1600, 25), (36, 1600, 25), (40, 1600, 25), (48, 1600, 25), (40, 1920, 30),
          (48, 1920, 30), (48, 2048, 32), (44, 2304, 36)]


# ---- one training configuration ------------------------------------------------------------------------------
def model_config(shape) -> ModelConfig:
    if shape == MEMORY_BOUND[0]:
        return ModelConfig(shape, **MEMORY_BOUND[1], dropout=0.0, attn_dropout=0.0)
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


def _timed(fn, phase: str, ph: dict):
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ph[phase] = ph.get(phase, 0.0) + time.perf_counter() - t
    return run


def build(impl: str, cfg: ModelConfig, topo: Topology, ph: dict, seed: int = 0):
    """(model, train_step(x, y) -> loss, state_bytes() -> params + optimizer bytes, comm() -> bytes last step).
    `ph` accumulates seconds per phase (PHASES)."""
    if impl.startswith("zero"):
        stage = int(impl[-1])
        model = GPT(cfg, topo, device="meta" if stage == 3 else None)
        init_fn = None
        if stage == 3:  # materialised unit by unit, from the same per-name init as init_weights
            init_fn = lambda mod, name, t, spec: init_parameter_(model, mod, name, t, spec, seed)  # noqa: E731
        else:
            init_weights(model, seed)
        engine = ZeroEngine(model, topo, stage=stage, lr=1e-4, weight_decay=0.1, grad_clip=1.0, init_fn=init_fn)
        z = engine.zero  # time the phases of optimizer_step from outside (works on any version of the stages)
        z.finish_gradients = _timed(z.finish_gradients, "reduce wait", ph)
        z.grad_norm = _timed(z.grad_norm, "grad norm", ph)
        z.clip_, z.step = _timed(z.clip_, "optimizer", ph), _timed(z.step, "optimizer", ph)

        def train_step(x, y):
            engine.comm.reset()
            loss = _timed(lambda: model.loss(model(x), y), "forward", ph)()
            _timed(engine.backward, "backward", ph)(loss)
            engine.step()
            ph["all-gather wait"] = sum(getattr(z, "wait_s", {}).values())  # cumulative since construction
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

    clip, zero_grad = torch.nn.utils.clip_grad_norm_, lambda: opt.zero_grad(set_to_none=True)  # noqa: E731

    def train_step(x, y):
        loss = _timed(lambda: model.loss(wrapped(x), y), "forward", ph)()
        _timed(loss.backward, "backward", ph)()
        _timed(clip, "grad norm", ph)(model.parameters(), 1.0)
        _timed(opt.step, "optimizer", ph)()
        _timed(zero_grad, "optimizer", ph)()
        return loss.detach()

    def mem():
        states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        return _local_bytes(model.parameters()) + _local_bytes(states)

    return model, train_step, mem, lambda: None


def train_worker(impl: str, shape, seq: int, micro_batch: int, warmup: int, steps: int) -> dict:
    topo = Topology.build(dp=dist.get_world_size())
    cfg = model_config(shape)
    t0, ph = time.perf_counter(), {}
    model, train_step, state_bytes, comm = build(impl, cfg, topo, ph)
    built = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1000 + topo.dp_rank)
    batches = [torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=gen)
               for _ in range(warmup + steps)]
    losses = [train_step(b[:, :-1], b[:, 1:]) for b in batches[:warmup]]
    dist.barrier()  # the window below is the slowest rank's `steps` steps
    start, cpu_start, before = time.perf_counter(), time.process_time(), dict(ph)
    losses += [train_step(b[:, :-1], b[:, 1:]) for b in batches[warmup:]]
    dist.barrier()
    step_s, cpu_s = (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps
    phases = {k: (ph.get(k, 0.0) - before.get(k, 0.0)) / steps for k in PHASES}
    # CPU seconds (all threads of this rank) are the contention-robust cost; wall seconds the throughput seen.
    return {"step_s": step_s, "cpu_s": cpu_s, "losses": [x.item() for x in losses],
            "build_s": built, "phases": phases,
            "peak_rss": peak_rss(), "state_bytes": state_bytes(), "comm_bytes": comm(),
            "params": sum(p.numel() for p in model.parameters()) if impl != "zero3" else cfg.num_parameters(),
            "tokens_per_step": topo.dp * micro_batch * seq}


def idle_worker() -> dict:
    return {"peak_rss": peak_rss()}


# ---- the two parts -------------------------------------------------------------------------------------------
def run_throughput(args) -> list[dict]:
    models = [("gpt2-tiny", 128, 8)] if args.quick else [(MEMORY_BOUND[0], 128, 1),
                                                          ("gpt2-117m", args.seq, args.micro_batch)]
    models = [m for m in models if not args.models or m[0] in args.models]
    impls = tuple(i for i in IMPLS if i in args.impls)
    idle, _ = launch(idle_worker, 2, mmap_large=not args.default_malloc)
    rows = [{"model": "-", "impl": "idle rank", "peak_rss": [r["peak_rss"] for r in idle]}]
    for name, seq, mb in models:
        runs: dict[str, list[dict]] = {impl: [] for impl in impls}
        for round_ in range(args.rounds):  # interleaved rounds, alternating order
            for impl in impls if round_ % 2 == 0 else impls[::-1]:
                res, why = launch(train_worker, 2, impl, name, seq, mb, args.warmup, args.steps,
                                  mmap_large=not args.default_malloc)
                row = {"model": name, "seq": seq, "micro_batch": mb, "impl": impl, "failed": why,
                       "loadavg_1m": os.getloadavg()[0]}
                if res:
                    r0 = res[0]
                    row.update(params=model_config(name).num_parameters(), step_s=r0["step_s"],
                               tokens_per_step=r0["tokens_per_step"],
                               cpu_s=max(r["cpu_s"] for r in res),
                               tokens_per_s=r0["tokens_per_step"] / r0["step_s"], losses=r0["losses"],
                               peak_rss=[r["peak_rss"] for r in res], state_bytes=[r["state_bytes"] for r in res],
                               comm_bytes=r0["comm_bytes"], build_s=r0["build_s"],
                               phases={k: max(r["phases"][k] for r in res) for k in PHASES})
                runs[impl].append(row)
                done = f"FAILED {why}" if why else f"{row['tokens_per_s']:.0f} tok/s"
                print(f"  {name} {impl} (round {round_ + 1}): {done} (load {row['loadavg_1m']:.1f})",
                      file=sys.stderr, flush=True)
        rows += [_combine(runs[impl], runs) for impl in impls]
    return rows


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def _combine(mine: list[dict], runs: dict[str, list[dict]]) -> dict:
    """One row from an implementation's rounds: median step time, CPU time and phases, max peak RSS, and the
    median over rounds of the tokens/s ratio to DDP and to FSDP2 measured in the same round."""
    ok = [r for r in mine if not r["failed"]]
    if not ok:
        return mine[-1]
    row = dict(ok[len(ok) // 2], rounds=len(ok))
    row["step_s"], row["cpu_s"] = _median([r["step_s"] for r in ok]), _median([r["cpu_s"] for r in ok])
    row["tokens_per_s"] = row["tokens_per_step"] / row["step_s"]
    row["loadavg_1m"] = _median([r["loadavg_1m"] for r in ok])
    row["peak_rss"] = [max(rank) for rank in zip(*(r["peak_rss"] for r in ok))]
    row["phases"] = {k: _median([r["phases"][k] for r in ok]) for k in PHASES}
    for ref in (r for r in ("ddp", "fsdp2") if r in runs):
        pairs = [(r["step_s"], o["step_s"]) for r, o in zip(mine, runs[ref]) if not r["failed"] and not o["failed"]]
        row[f"vs_{ref}"] = _median([o / m for m, o in pairs]) if pairs else None
    return row


def estimate_rank_bytes(stage: int, n_params: int, cfg: ModelConfig, world: int) -> float:
    """Per-rank peak of one attempt, to choose where the search starts (the run itself decides). fp32 model
    states: stage 0 holds 4 (params) + 4 (grads) + 8 (Adam moments) bytes per parameter; stages 1 / 2 / 3
    partition the 8 / 12 / 16 of them (the owned fp32 chunk is its own master). Transients: the tied embedding's
    one dense gradient and its reduce-scatter output (stage 3: ~2 root units), and a few gathered blocks with
    their gradients."""
    root = cfg.padded_vocab(1) * cfg.d_model * 4
    block = (n_params - cfg.padded_vocab(1) * cfg.d_model) / cfg.n_layer * 4
    base = 0.4 * GiB  # forked rank with torch and a process group (~0.2 GB measured) + activations at seq <= 64
    if stage < 3:
        return {0: 16, 1: 8 + 8 / world, 2: 4 + 12 / world}[stage] * n_params + 2 * root + base
    return 16 * n_params / world + 2 * root + 4 * block + base


def run_largest(args) -> dict:
    world, seq = 4, args.largest_seq
    budget = mem_available() - args.reserve_gib * GiB  # what the attempt's 4 ranks may use in all
    out = {"world": world, "seq": seq, "budget_bytes": budget, "attempts": [], "largest": {}}
    # Ordered by parameter count: moving up a rung always means a larger model.
    ladder = sorted(((shape, model_config(shape).num_parameters()) for shape in LADDER), key=lambda r: r[1])
    for stage in args.largest_stages:
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
    a, b = out["largest"].get(0), out["largest"].get(max(args.largest_stages))
    out["ratio"] = b["params"] / a["params"] if a and b else None
    return out
