"""Pipeline bubble, throughput and activation memory per schedule, measured next to the theory.

benchmarks/pipeline.py prints these rows as a table and `megazoo reproduce pipeline-bubble` as a report with a
figure; both call `measure_schedules` here, so an installed megazoo measures without a checkout.

For each (pp, schedule) the real Trainer runs a few steps on `pp` local gloo ranks (CPU) and every rank reports
its PipelineEngine statistics: compute time vs wall time (the bubble), compute seconds per action kind (F, B,
W), the most micro-batches whose activations were alive at once, and the step's wall time (tokens/s). Theory,
with F = B = W: bubble (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved, (p-1)/(3m+p-1) for
ZB-H1 ((p-1)(F+B-W) of idle), (p-1)/(6m+p-1) for ZBV (rank r starts at r, 6m units of work each) and for
DualPipeV run without overlapping its paired F and B (it needs m >= 2p - 1: rows with fewer are left out); "ideal" is
the same schedule's own action lists run on parallel/pipeline/timeline.py's ideal pipeline (equal to the
formula for m >= p). 1F1B keeps at most p micro-batches of activations on the first stage, GPipe m, ZB-H1 p on
every rank (held from F to W), ZBV 2p half-size chunks, DualPipeV 2p + 1.

On a 2-core CPU machine 4 ranks share 2 cores, so the measured bubble is inflated by time-slicing; the
activation counts are exact everywhere. F / B / W seconds: the compute of each action kind per rank (an unsplit
schedule's B is its whole backward; a zero-bubble W re-runs only the weight nodes: parallel/pipeline/
split_backward.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from megazoo.parallel.pipeline.schedules import placement, schedule as actions_of
from megazoo.parallel.pipeline.timeline import simulate
from megazoo.parallel.topology import Topology
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer
from megazoo.workers.local import run_distributed

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb_h1": 1, "zbv": 2, "dualpipev": 2}  # virtual stages


def _measure(table: dict, warmup: int):
    res = resolve(from_dict(Recipe, table))
    par = res.recipe.parallel
    trainer = Trainer(res, Topology.build(par.dp, par.tp, par.pp))
    for step in range(warmup):
        trainer.train_step(step)
    trainer.engine.stats.reset()
    start = time.perf_counter()
    for step in range(warmup, res.recipe.train.steps):
        trainer.train_step(step)
    seconds = time.perf_counter() - start
    stats = trainer.engine.stats
    t = res.recipe.train
    act_bytes = t.micro_batch * t.seq_len * res.model.d_model * 4
    return {"pp_rank": trainer.topo.pp_rank, "bubble": stats.bubble, "live": stats.max_live_micro_batches,
            "activation_bytes": stats.max_live_micro_batches * act_bytes, "compute_s": stats.compute_s,
            "tokens_per_s": (t.steps - warmup) * t.grad_accum * t.micro_batch * t.seq_len / seconds}


def theory(schedule: str, p: int, m: int, v: int) -> float:
    """The bubble fraction with F = B = W (formulas in the module docstring)."""
    if schedule == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    if schedule in ("zbv", "dualpipev"):
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)


def ideal(schedule: str, p: int, m: int, v: int) -> float:
    """The bubble of the schedule's own action lists on an ideal pipeline (F = B = W = 1, free communication)."""
    return simulate([actions_of(schedule, m, p, r, v) for r in range(p)], p * v, placement(schedule)).bubble


def recipe_table(pp: int, schedule: str, m: int, steps: int, layers: int) -> dict:
    """The measured job: gpt2-tiny with `layers` blocks, micro-batch 4 x seq 64, fp32, synthetic data; one
    warm-up step before the `steps` timed ones."""
    return {
        "model": {"preset": "gpt2-tiny", "n_layer": layers, "vocab_size": 512, "dropout": 0.0, "attn_dropout": 0.0},
        "parallel": {"pp": pp, "schedule": schedule, "virtual_stages": SCHEDULES[schedule]},
        "train": {"steps": steps + 1, "micro_batch": 4, "grad_accum": m, "seq_len": 64, "precision": "fp32"},
        "data": {"source": "synthetic", "synthetic_tokens": 100_000},
        "logging": {"progress": False},
    }


def measure_schedules(m: int = 8, steps: int = 4, layers: int = 8, schedules=tuple(SCHEDULES),
                      pps=(2, 4), report: Callable[[str], None] = lambda line: None) -> list[dict]:
    """One row per (pp, schedule): measured, theoretical and ideal bubble, tokens/s, F / B / W compute seconds
    per rank, live micro-batches per stage, and the first stage's activation MiB. `schedules` must be names of
    SCHEDULES (the caller checks its input); DualPipeV is left out (and reported) where m < 2 pp - 1."""
    rows = []
    for pp in pps:
        for schedule in schedules:
            v = SCHEDULES[schedule]
            if schedule == "dualpipev" and m < 2 * pp - 1:
                report(f"pp {pp} dualpipev left out: it needs --m >= {2 * pp - 1}")
                continue
            ranks = run_distributed(_measure, pp, recipe_table(pp, schedule, m, steps, layers), 1)
            kinds = {k: statistics.mean(r["compute_s"].get(k, 0.0) for r in ranks) for k in "FBW"}
            rows.append({"pp": pp, "schedule": schedule, "v": v, "m": m,
                         "bubble_measured": statistics.mean(r["bubble"] for r in ranks),
                         "bubble_theory": theory(schedule, pp, m, v),
                         "bubble_ideal": ideal(schedule, pp, m, v),
                         "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in ranks),
                         "compute_s_per_rank": kinds,
                         "live_per_stage": [r["live"] for r in sorted(ranks, key=lambda r: r["pp_rank"])],
                         "activation_mb_first_stage": ranks[0]["activation_bytes"] / 2**20})
    return rows
