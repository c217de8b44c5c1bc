"""The loss bound of ZeRO++'s quantized collectives: gpt2-tiny trained N steps at dp 4 = 2 nodes x 2 with qwZ
(int8 weight gathers), qgZ int8 / int4 (hierarchical gradient reduce) and hpZ + qwZ + qgZ, against the same run
unquantized (flat ZeRO-3, same seed, data and order). Prints the final training loss (mean of the last 10 steps),
the validation loss at the end and their relative difference to the unquantized run.

    .venv/bin/python -m benchmarks.quantized_loss --steps 300

All layouts train side by side in one launch of 4 forked gloo ranks (workers/local.py), fp32, synthetic tokens
with a learnable successor structure (data/token_dataset.py) so the loss falls well below log(vocab).
tests/parallel/zero/test_quantized_loss.py holds a shorter run of the same function (< 1%, and not equal: quantized).
"""

from __future__ import annotations

import argparse
import copy
import json

from megazoo.parallel.topology import Topology
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer
from megazoo.workers.local import run_distributed

BASE = {
    "model": {"preset": "gpt2-tiny", "vocab_size": 512, "dropout": 0.0, "attn_dropout": 0.0},
    "parallel": {"dp": 4, "node_size": 2},
    "zero": {"stage": 3},
    "train": {"steps": 300, "micro_batch": 4, "grad_accum": 1, "seq_len": 64, "lr": 2e-3, "min_lr": 2e-4,
              "warmup_steps": 20, "grad_clip": 1.0, "seed": 11, "eval_batches": 4, "precision": "fp32"},
    "data": {"source": "synthetic", "synthetic_tokens": 200_000},
    "logging": {"progress": False},
    "checkpoint": {"at_end": False},
    "kernels": {"adamw": "reference"},
}
LAYOUTS = {  # name: zero keys on top of stage 3 (the first is the unquantized reference)
    "zero3": {},
    "qwz": {"quantized_weights": True},
    "qgz-int8": {"quantized_gradients": "int8"},
    "qgz-int4": {"quantized_gradients": "int4"},
    "hpz+qwz+qgz-int4": {"hpz": True, "quantized_weights": True, "quantized_gradients": "int4"},
}
TAIL = 10  # final training loss: the mean of the last TAIL steps (one step's loss is one batch's noise)


def recipe(layout: str, steps: int, model: dict | None = None, train: dict | None = None) -> Recipe:
    table = copy.deepcopy(BASE)
    table["zero"].update(LAYOUTS[layout])
    table["train"].update({**(train or {}), "steps": steps})
    table["model"].update(model or {})
    return from_dict(Recipe, table)


def _train_all(steps: int, layouts: list[str], model: dict | None, train: dict | None) -> dict:
    topo = Topology.build(4, node_size=2)
    out = {}
    for name in layouts:
        trainer = Trainer(resolve(recipe(name, steps, model, train)), topo)
        losses = trainer.fit().losses
        out[name] = {"losses": losses, "final": sum(losses[-TAIL:]) / len(losses[-TAIL:]),
                     "val": trainer.evaluate(), "masters": sorted({str(m.dtype) for m in trainer.zero.masters})}
    return out


def measure(steps: int, layouts: list[str] | None = None, model: dict | None = None,
            train: dict | None = None) -> dict:
    """{layout: {"losses", "final", "val", "final_rel", "val_rel", "masters"}} from rank 0; rel = vs the first
    layout. `model` / `train`: keys over BASE's (the test's smaller run)."""
    layouts = layouts or list(LAYOUTS)
    got = run_distributed(_train_all, 4, steps, layouts, model, train, timeout_s=3600)[0]
    ref = got[layouts[0]]
    for row in got.values():
        row["final_rel"] = (row["final"] - ref["final"]) / ref["final"]
        row["val_rel"] = (row["val"] - ref["val"]) / ref["val"]
    return got


def table(got: dict, steps: int) -> str:
    lines = [f"| layout ({steps} steps) | final train loss (last {TAIL}) | vs zero3 | val loss | vs zero3 |",
             "|:---|---:|---:|---:|---:|"]
    for name, row in got.items():
        lines.append(f"| {name} | {row['final']:.5f} | {row['final_rel']:+.3%} | {row['val']:.5f} | "
                     f"{row['val_rel']:+.3%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="also write the losses here")
    args = parser.parse_args(argv)
    if args.steps < TAIL:
        parser.error(f"--steps {args.steps} is invalid; valid: at least {TAIL}")
    got = measure(args.steps)
    print(table(got, args.steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f)


if __name__ == "__main__":
    main()
