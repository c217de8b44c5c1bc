"""Where ZeRO-3's step time goes, next to DDP's, on benchmarks/zero.py's memory-bound model (dp=2, gloo).

    python -m benchmarks.zero3_profile                 # zero3 and ddp, 1 warm-up + 3 timed steps
    python -m benchmarks.zero3_profile --impls zero3 --steps 5

Every ZeRO-3 hook, gather / free, gradient copy, reduce-scatter launch / finish, all-gather wait and optimizer
piece is wrapped (class level, in the forked ranks only) by a host-clock timer that keeps inclusive and self
(exclusive of the wrapped calls inside it) seconds and call counts. "compute" is the forward / backward phase
minus the self time of everything wrapped inside it: what is left is autograd's own work. The table is rank 0's
mean per timed step; DDP's rows give the compute a step needs without sharding.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from megazoo.models.transformer import GPT
from megazoo.parallel import collectives
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero import partitioned, stage3
from megazoo.recipes.reproduce.zero_bench import MEMORY_BOUND, build, model_config
from megazoo.workers.guarded import launch

WRAPPED = {
    stage3.ZeroStage3: ("_pre_forward", "_post_forward", "_pre_backward", "_before_model_forward",
                        "_after_model_forward", "_on_grad_ready", "_reduce_and_free", "_gather", "_free",
                        "_timed_wait", "finish_gradients", "update_owned", "write_owned", "release_owned_grads",
                        "grad_norm", "clip_"),
    partitioned.GradientReducer: ("launch", "_finish_oldest"),
    collectives.Exchange: ("wait",),
}
OUTER = ("GPT.forward", "torch.autograd.backward", "AdamW.step")  # wrapped for every implementation
MODULE_FUNCS = {collectives: ("_exchange_all_gather", "_exchange_reduce_scatter")}


class Timers:
    def __init__(self):
        self.incl, self.self_, self.calls = defaultdict(float), defaultdict(float), defaultdict(int)
        self.faults = defaultdict(float)  # self minor page faults (this thread's: the fault is where memory is touched)
        self.stack: list[list[float]] = []  # per open call: children's inclusive seconds, then faults

    def wrap(self, name: str, fn):
        def run(*args, **kwargs):
            self.stack.append([0.0, 0])
            t, f = time.perf_counter(), _faults()
            try:
                return fn(*args, **kwargs)
            finally:
                dt, df = time.perf_counter() - t, _faults() - f
                children, child_faults = self.stack.pop()
                self.incl[name] += dt
                self.self_[name] += dt - children
                self.faults[name] += df - child_faults
                self.calls[name] += 1
                if self.stack:
                    self.stack[-1][0] += dt
                    self.stack[-1][1] += df
        return run

    def snapshot(self):
        return dict(self.incl), dict(self.self_), dict(self.calls), dict(self.faults)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _install(timers: Timers) -> None:
    for cls, names in WRAPPED.items():
        for n in names:
            setattr(cls, n, timers.wrap(f"{cls.__name__}.{n}", getattr(cls, n)))
    for mod, names in MODULE_FUNCS.items():
        for n in names:
            setattr(mod, n, timers.wrap(n, getattr(mod, n)))


def worker(impl: str, warmup: int, steps: int) -> dict:
    timers = Timers()
    if impl == "zero3":
        _install(timers)
    # The outer frames, for every implementation (DDP's rows are these three alone).
    GPT.forward = timers.wrap("GPT.forward", GPT.forward)
    torch.autograd.backward = timers.wrap("torch.autograd.backward", torch.autograd.backward)
    torch.optim.AdamW.step = timers.wrap("AdamW.step", torch.optim.AdamW.step)
    topo = Topology.build(dp=dist.get_world_size())
    cfg = model_config(MEMORY_BOUND[0])
    ph: dict = {}
    model, train_step, _, _ = build(impl, cfg, topo, ph)
    # The phase timers of zero_bench count as wrapped calls: forward / backward are the outer frames.
    gen = torch.Generator().manual_seed(1000 + topo.dp_rank)
    batches = [torch.randint(0, cfg.vocab_size, (1, 129), generator=gen) for _ in range(warmup + steps)]
    for b in batches[:warmup]:
        train_step(b[:, :-1], b[:, 1:])
    dist.barrier()
    before_ph, (incl0, self0, calls0, faults0) = dict(ph), timers.snapshot()
    start, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for b in batches[warmup:]:
        train_step(b[:, :-1], b[:, 1:])
    dist.barrier()
    step_s = (time.perf_counter() - start) / steps
    ru = resource.getrusage(resource.RUSAGE_SELF)
    os_ = {"user_s": (ru.ru_utime - ru0.ru_utime) / steps, "sys_s": (ru.ru_stime - ru0.ru_stime) / steps,
           "minor_faults": (ru.ru_minflt - ru0.ru_minflt) / steps}
    incl, self_, calls, faults = timers.snapshot()
    per = lambda d, d0: {k: (v - d0.get(k, 0.0)) / steps for k, v in d.items()}  # noqa: E731
    return {"step_s": step_s, "os": os_, "phases": per(ph, before_ph), "incl": per(incl, incl0), "self": per(self_, self0),
            "calls": per(calls, calls0), "faults": per(faults, faults0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zero3_profile", description=__doc__.splitlines()[0])
    p.add_argument("--impls", nargs="+", default=["zero3", "ddp"], choices=("zero3", "ddp", "zero2"))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    for impl in args.impls:
        res, why = launch(worker, 2, impl, args.warmup, args.steps)
        if why:
            print(f"{impl}: FAILED {why}")
            continue
        r = res[0]
        print(f"\n{impl}: step {r['step_s']:.3f} s (rank 0, mean of {args.steps}); phases: "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items()))
        print("CPU per step (rank 0, all threads): user {user_s:.2f} s, system {sys_s:.2f} s, minor page faults "
              "{minor_faults:.0f} ({mib:.0f} MiB of 4 KiB pages)".format(**r["os"], mib=r["os"]["minor_faults"] / 256))
        print(f"process minor faults {r['os']['minor_faults'] / 256:.0f} MiB/step, main thread's in wrapped calls "
              f"{sum(r['faults'].values()) / 256:.0f} MiB (the rest: gloo's threads, unwrapped code)")
        if r["self"]:
            print("| call | calls/step | inclusive s/step | self s/step | self page faults/step MiB |\n|---|---|---|---|---|")
            for k in sorted(r["self"], key=lambda k: -r["self"][k]):
                print(f"| {k} | {r['calls'][k]:.0f} | {r['incl'][k]:.3f} | {r['self'][k]:.3f} "
                      f"| {r['faults'].get(k, 0) / 256:.0f} |")
            hooks = sum(v for k, v in r["self"].items() if k not in OUTER)
            print(f"ZeRO-3's wrapped self total {hooks:.3f} s/step; step minus it (model compute, autograd, AdamW, "
                  f"DDP's hooks) {r['step_s'] - hooks:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
