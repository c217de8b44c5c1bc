"""DualPipe-V's forward/backward overlap measured beside 1F1B, ZBV and DualPipe-V without it, on an MoE model.

benchmarks/pipeline.py --overlap prints these rows. Each row is the real Trainer on a small llama-style MoE
(every block an MoE block, 4 experts top-2), fp32, pp 2 x dp 2 with ep 2 (4 gloo ranks on the CPU), the same
micro-batches; the rows differ only in parallel.schedule and parallel.fb_overlap:

- 1f1b (one chunk per rank), zbv and dualpipev (two), all through PipelineEngine: the expert all-to-alls are
  synchronous, inside the chunk's forward and backward;
- dualpipev + fb_overlap ("on"): OverlapPipelineEngine; each paired F and B of two micro-batches run as
  sub-stages, each all-to-all (the per-expert counts' too) travelling while the other micro-batch computes;
- dualpipev, "sub-stages": the same engine with its pairing off (OverlapPipelineEngine.pair = False): every action
  alone, each all-to-all waited right after its launch. The control row: what the sub-staging costs by itself,
  so that "on" against it is the overlap's own effect.
`overlaps` (JSON only): computes of one micro-batch that ran while another's all-to-all was in flight, per rank
and step, from the overlap engine's event log (fb_overlap.overlapped): 0 without the pairing.

`repeat` runs every row that many times, the rows interleaved (so a change in the machine's load reaches every
row alike), and reports each figure's median.

Per rank, over the timed steps (then averaged over ranks), as fractions of the schedule's wall time
(PipelineStats.total_s: from the first action to the last, the optimizer step excluded):
- bubble: the time outside actions (waiting on p2p transfers, idle): 1 - busy / total, busy being the time inside
  actions - in both engines an all-to-all wait happens inside an action, so it counts as busy, not bubble;
- exposed all-to-all: the host seconds this rank was blocked in an all-to-all - a synchronous
  all_to_all_single call, or the wait() of an asynchronous one's handle;
- compute: busy - exposed all-to-all.

How the exposed all-to-all time is measured: each worker process wraps torch.distributed.all_to_all_single
(`_TimedAllToAll`, this benchmark's test double around the real collective, the same for every row) and sums
the time blocked in it. For the overlap row the engine's own event log (fb_overlap.Events.wait_s, the waits on
the handles) is reported beside it; the two measure the same waits, the log's also holding the split sizes' host
read that follows the counts' wait. `latency_ms` > 0 emulates a slower link: the
wrapper holds each all-to-all's result back until that many ms after its launch (a sleep in the synchronous call,
or in the handle's wait). It is labelled in every row: an emulated latency, not a measured network.

Gloo on a shared CPU: the ranks time-slice the cores, so a wait also holds the time its peer spent computing (the
peer is behind); the overlap hides that skew as it would a slow link. Host clocks: on GPUs an NCCL handle's
wait() only orders streams, so this method does not carry over there (it would need CUDA events).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch.distributed as dist

from megazoo.parallel.pipeline.fb_overlap import overlapped
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.reproduce.pipeline_bench import theory
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer
from megazoo.workers.local import run_distributed

# (schedule, fb_overlap): "off" (PipelineEngine), "sub-stages" (the overlap engine unpaired), "on"
ROWS = (("1f1b", "off"), ("zbv", "off"), ("dualpipev", "off"), ("dualpipev", "sub-stages"), ("dualpipev", "on"))


class _TimedAllToAll:
    """torch.distributed.all_to_all_single with the host time blocked in it counted (`blocked`) and, with
    `latency_s`, each result held back until latency_s after its launch (the emulated link)."""

    def __init__(self, real: Callable, latency_s: float):
        self.real, self.latency_s, self.blocked = real, latency_s, 0.0

    def __call__(self, *args, async_op: bool = False, **kwargs):
        launched = time.perf_counter()
        work = self.real(*args, async_op=async_op, **kwargs)
        if async_op:
            return _Held(work, launched, self)
        self.hold(launched)
        self.blocked += time.perf_counter() - launched
        return work

    def hold(self, launched: float) -> None:
        left = launched + self.latency_s - time.perf_counter()
        if left > 0:
            time.sleep(left)


class _Held:
    """An asynchronous all-to-all's handle whose wait() is timed (and held back by the emulated latency)."""

    def __init__(self, work, launched: float, timer: _TimedAllToAll):
        self.work, self.launched, self.timer = work, launched, timer

    def wait(self, *args, **kwargs) -> bool:
        started = time.perf_counter()
        self.work.wait(*args, **kwargs)
        self.timer.hold(self.launched)
        self.timer.blocked += time.perf_counter() - started
        return True


def recipe_table(schedule: str, fb_overlap: bool, m: int, steps: int, layers: int, d_model: int) -> dict:
    """The measured job: a llama-style MoE of `layers` blocks (all MoE: 4 experts, top-2, expert width d_model),
    micro-batch 4 x seq 64, fp32, synthetic data, pp 2 x dp 2 with ep 2; one warm-up step before `steps`."""
    return {
        "model": {"preset": "llama-tiny", "n_layer": layers, "d_model": d_model, "n_head": 4, "n_kv_head": 2,
                  "d_ff": 2 * d_model, "vocab_size": 512, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": d_model,
                  "dropout": 0.0, "attn_dropout": 0.0},
        "parallel": {"pp": 2, "dp": 2, "ep": 2, "schedule": schedule, "fb_overlap": fb_overlap,
                     "virtual_stages": 1 if schedule == "1f1b" else 2},
        "train": {"steps": steps + 1, "micro_batch": 4, "grad_accum": m, "seq_len": 64, "precision": "fp32",
                  "fused_loss": "off"},
        "data": {"source": "synthetic", "synthetic_tokens": 100_000},
        "logging": {"progress": False},
        "checkpoint": {"at_end": False},
    }


def _measure(table: dict, latency_s: float, pair: bool) -> dict:
    timer = _TimedAllToAll(dist.all_to_all_single, latency_s)
    dist.all_to_all_single = timer  # this forked worker's only: every row's all-to-alls go through it
    try:
        res = resolve(from_dict(Recipe, table))
        trainer = Trainer(res, Topology.of(res.recipe.parallel))
        if hasattr(trainer.engine, "pair"):
            trainer.engine.pair = pair
        trainer.train_step(0)  # warm-up
        trainer.engine.stats.reset()
        timer.blocked, logged, overlaps = 0.0, 0.0, 0
        for step in range(1, res.recipe.train.steps):
            trainer.train_step(step)
            events = getattr(trainer.engine, "events", None)  # the overlap engine's log of the last run
            if events is not None:
                logged += sum(events.wait_s.values())
                overlaps += len(overlapped(events))
        stats = trainer.engine.stats
        return {"total_s": stats.total_s, "busy_s": stats.busy_s, "a2a_s": timer.blocked,
                "a2a_logged_s": logged if hasattr(trainer.engine, "events") else None, "overlaps": overlaps}
    finally:
        dist.all_to_all_single = timer.real


def measure_overlap(m: int = 8, steps: int = 3, layers: int = 4, d_model: int = 64, latencies_ms=(0.0,),
                    rows=ROWS, repeat: int = 1, report: Callable[[str], None] = lambda line: None) -> list[dict]:
    """One row per (latency, schedule, fb_overlap): bubble, exposed all-to-all and compute as fractions of the
    schedule's wall time (averaged over the 4 ranks; the median of `repeat` runs), the theory's bubble, and the
    schedule's wall time per step."""
    if m < 3:
        raise ValueError(f"--m {m}: DualPipe-V at pp 2 needs m >= 3 micro-batches")
    runs: dict[tuple, list[dict]] = {}
    for rep in range(repeat):
        for latency in latencies_ms:
            for schedule, mode in rows:
                report(f"run {rep + 1}/{repeat}, latency {latency:g} ms: {schedule}, fb_overlap {mode}")
                ranks = run_distributed(_measure, 4, recipe_table(schedule, mode != "off", m, steps, layers,
                                                                  d_model), latency / 1000.0, mode == "on")
                logged = [r["a2a_logged_s"] / r["total_s"] for r in ranks if r["a2a_logged_s"] is not None]
                runs.setdefault((latency, schedule, mode), []).append({
                    "bubble": statistics.mean(1 - r["busy_s"] / r["total_s"] for r in ranks),
                    "a2a_exposed": statistics.mean(r["a2a_s"] / r["total_s"] for r in ranks),
                    "a2a_logged": statistics.mean(logged) if logged else None,
                    "compute": statistics.mean((r["busy_s"] - r["a2a_s"]) / r["total_s"] for r in ranks),
                    "step_s": statistics.mean(r["total_s"] for r in ranks) / steps,
                    "overlaps": statistics.mean(r["overlaps"] for r in ranks) / steps})
    out = []
    for (latency, schedule, mode), got in runs.items():
        v = 1 if schedule == "1f1b" else 2
        row = {"schedule": schedule, "fb_overlap": mode, "v": v, "m": m, "latency_ms": latency, "runs": len(got),
               "bubble_theory": theory(schedule, 2, m, v)}
        for key in ("bubble", "a2a_exposed", "a2a_logged", "compute", "step_s", "overlaps"):
            values = [g[key] for g in got if g[key] is not None]
            row[key] = statistics.median(values) if values else None
        out.append(row)
    return out


def markdown(rows: list[dict]) -> list[str]:
    """The table benchmarks/pipeline.py --overlap prints (and the README shows); medians of the runs."""
    lines = ["| emulated a2a latency | schedule | fb_overlap | v | m | bubble | bubble theory | exposed all-to-all "
             "(event log) | compute | schedule s / step | vs dualpipev without overlap |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next((b for b in rows if b["latency_ms"] == r["latency_ms"] and b["schedule"] == "dualpipev"
                     and b["fb_overlap"] == "off"), None)
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        logged = f" ({r['a2a_logged']:.3f})" if r["a2a_logged"] is not None else ""
        lines.append(f"| {r['latency_ms']:g} ms | {r['schedule']} | {r['fb_overlap']} | {r['v']} | "
                     f"{r['m']} | {r['bubble']:.3f} | {r['bubble_theory']:.3f} | {r['a2a_exposed']:.3f}{logged} | "
                     f"{r['compute']:.3f} | {r['step_s']:.3f} | {ratio} |")
    return lines
