"""Activation memory per pipeline schedule: the planner's peak beside the real run's, every rank.

For each pp and schedule one real training step runs on pp local gloo ranks (CPU, fp32, gpt2-tiny, micro-batch
2 x 64 tokens, no dropout; 4 blocks at pp 2 and 8 at pp 4 - one block per virtual stage under the V - with 4
micro-batches at pp 2 and 8 at pp 4) under the dry run's MemoryTracker (parallel/simulation/fake_world.py). Measured: the
bytes the step created beyond the model states (activations + backward temporaries) at their highest until the
schedule has run - the optimizer step after it makes its own temporaries (AdamW's), which the planner counts
elsewhere. Planner: recipes/dry_run/report.planned(...)["activations"], the walk of the rank's action list
(recipes/planner/schedule_memory.py). tests/recipes/planner/test_schedule_memory.py holds every rank within 10%.

    python benchmarks/schedule_memory.py [--pp 2,4] [--schedules gpipe,1f1b,...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazoo.parallel.checkpoint.views import ensure_adam_state  # noqa: E402
from megazoo.parallel.simulation.fake_world import MemoryTracker  # noqa: E402
from megazoo.parallel.topology import Topology  # noqa: E402
from megazoo.recipes.dry_run.run import load, shaped_data  # noqa: E402
from megazoo.recipes.dry_run.report import planned  # noqa: E402
from megazoo.recipes.training.trainer import Trainer  # noqa: E402  (imported before the ranks fork)
from megazoo.workers.local import run_distributed  # noqa: E402

CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb_h1": 1, "zbv": 2, "dualpipev": 2}
SHAPE = {2: (4, 4), 4: (8, 8)}  # pp -> (blocks, micro-batches): dualpipev needs 2 pp - 1, interleaved k pp

TINY = """
[model]
preset = "gpt2-tiny"
n_layer = {n_layer}
vocab_size = 300
dropout = 0.0
attn_dropout = 0.0
[parallel]
pp = {pp}
schedule = "{schedule}"
virtual_stages = {virtual}
[zero]
stage = 1
[train]
steps = 1
micro_batch = 2
grad_accum = {m}
seq_len = 64
precision = "fp32"
[data]
source = "synthetic"
synthetic_tokens = 20000
[logging]
progress = false
[sample]
tokens = 0
[run]
dir = "{run_dir}"
"""


def write_recipe(folder: Path, pp: int, schedule: str) -> Path:
    n_layer, m = SHAPE[pp]
    path = folder / f"{schedule}-pp{pp}.toml"
    path.write_text(TINY.format(n_layer=n_layer, pp=pp, schedule=schedule, virtual=CHUNKS[schedule], m=m,
                                run_dir=folder / "run"))
    return path


def activation_peak(path) -> int:
    """Bytes this rank's real step created beyond the model states, at their highest until its schedule ran."""
    res = load(path)
    topo = Topology.build(1, 1, res.recipe.parallel.pp)
    peak = {}
    with MemoryTracker() as mem:
        trainer = Trainer(res, topo, shaped_data(res))
        zero = trainer.zero
        masters = [p for g in zero.optimizer.param_groups for p in g["params"]]
        ensure_adam_state(zero.optimizer, masters)  # created now: the step's AdamW then allocates no state
        moments = [v for state in zero.optimizer.state.values() for v in state.values() if hasattr(v, "shape")]
        params = [p for chunk in trainer.chunks for p in chunk.parameters()]
        mem.label(params=params, grads=[p.grad for p in params if p.grad is not None] + zero.gradients(),
                  optimizer=masters + moments, later_grads=zero.gradients)
        run = trainer.engine.run

        def measured_run(*args, **kwargs):
            out = run(*args, **kwargs)
            at = mem.peak()
            peak["bytes"] = at["activations"] + at["temporaries"]
            return out
        trainer.engine.run = measured_run
        trainer.train_step(0)
    return peak["bytes"]


def _measure_all(paths: dict) -> dict:
    return {name: activation_peak(path) for name, path in paths.items()}


def measure(pp: int, schedules, folder: Path) -> tuple[dict, list[dict]]:
    """One launch of pp ranks runs every schedule's step: ({schedule: recipe path}, [rank -> {schedule: bytes}])."""
    paths = {name: write_recipe(folder, pp, name) for name in schedules}
    return paths, run_distributed(_measure_all, pp, paths, timeout_s=240)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="2,4")
    ap.add_argument("--schedules", default=",".join(CHUNKS))
    args = ap.parse_args(argv)
    schedules = args.schedules.split(",")
    print("| schedule | pp | rank | planner MB | measured MB | measured / planner | planned as 1F1B MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for pp in (int(x) for x in args.pp.split(",")):
            paths, per_rank = measure(pp, schedules, Path(tmp))
            for name in schedules:
                res = load(paths[name])
                as_1f1b = load(paths[name], ["parallel.schedule=1f1b", "parallel.virtual_stages=1"])
                for rank in range(pp):
                    want, got = planned(res, rank)["activations"], per_rank[rank][name]
                    print(f"| {name} | {pp} | {rank} | {want / 1e6:.2f} | {got / 1e6:.2f} | {got / want:.3f} | "
                          f"{planned(as_1f1b, rank)['activations'] / 1e6:.2f} |")


if __name__ == "__main__":
    main()
