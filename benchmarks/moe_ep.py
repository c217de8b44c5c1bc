"""Expert parallelism on this machine: training tokens/s of a small MoE at ep 1 and ep 2 against the dense model
of equal active size, and the all-to-all bytes counted against the uniform-routing formula.

    python -m benchmarks.moe_ep                 # moe-demo's model (llama-tiny, 8 experts top-2), seq 128, micro 8
    python -m benchmarks.moe_ep --steps 10 --json out.json

Three layouts of 2 forked gloo processes each (dp 2, ZeRO-1, fp32, synthetic tokens): the dense llama-tiny
(SwiGLU width 344), the MoE with every expert on both ranks (ep 1: the local dispatcher), and the MoE at ep 2 (4
experts per rank, tokens by all-to-all). Each times `--steps` steps after `--warmup`; reported: tokens/s (both
ranks), seconds per step, and for ep 2 the all-to-all bytes rank 0 sent per step (parallel/expert/comms.py's
ledger) beside parallel.expert.all_to_all_bytes for uniform routing (the router is not uniform, so they differ by
the imbalance: to other ranks a balanced router sends (ep - 1) / ep of its rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazoo.parallel.expert import all_to_all_bytes  # noqa: E402
from megazoo.parallel.topology import Topology  # noqa: E402
from megazoo.recipes.config import Recipe, from_dict  # noqa: E402
from megazoo.recipes.resolve import resolve  # noqa: E402
from megazoo.recipes.training.trainer import Trainer  # noqa: E402
from megazoo.workers.local import run_distributed  # noqa: E402

MOE = {"n_experts": 8, "moe_top_k": 2, "moe_d_ff": 172, "moe_aux_loss_coef": 0.01}


def recipe(args, moe: bool, ep: int):
    return resolve(from_dict(Recipe, {
        "model": {"preset": "llama-tiny", "vocab_size": 4096, "dropout": 0.0, "attn_dropout": 0.0,
                  **(MOE if moe else {})},
        "parallel": {"dp": 2, "ep": ep},
        "zero": {"stage": 1},
        "train": {"steps": 10_000, "micro_batch": args.micro_batch, "grad_accum": 1, "seq_len": args.seq_len,
                  "precision": "fp32", "seed": 3},
        "data": {"source": "synthetic", "synthetic_tokens": 400_000},
        "logging": {"progress": False},
        "checkpoint": {"at_end": False},
        "run": {"dir": str(Path(args.run_dir) / f"{'moe' if moe else 'dense'}-ep{ep}")},
    }))


def _rank(res, warmup: int, steps: int):
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    for step in range(warmup):
        trainer.train_step(step)
    ledgers = [block.mlp.dispatcher.comm for block in trainer.chunks[0].h.values()
               if hasattr(getattr(block.mlp, "dispatcher", None), "comm")]
    for ledger in ledgers:
        ledger.reset()
    start = time.perf_counter()
    for step in range(warmup, warmup + steps):
        trainer.train_step(step)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "all_to_all_bytes": sum(ledger.bytes["all_to_all"] for ledger in ledgers),
            "moe_layers": len(ledgers)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--run-dir", default="runs/bench-moe-ep")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    tokens = 2 * args.micro_batch * args.seq_len * args.steps  # both ranks
    rows = {}
    for name, moe, ep in (("dense llama-tiny", False, 1), ("MoE 8x top-2, ep 1", True, 1),
                          ("MoE 8x top-2, ep 2", True, 2)):
        rank0 = run_distributed(_rank, 2, recipe(args, moe, ep), args.warmup, args.steps)[0]
        row = {"tokens_per_s": tokens / rank0["seconds"], "s_per_step": rank0["seconds"] / args.steps}
        if ep > 1:
            per_step = rank0["all_to_all_bytes"] / args.steps
            formula = rank0["moe_layers"] * all_to_all_bytes(args.micro_batch * args.seq_len, MOE["moe_top_k"],
                                                             128, ep, 4)
            row.update(all_to_all_bytes_per_step=per_step, uniform_formula_bytes=formula)
        rows[name] = row
    print("| layout (dp 2, ZeRO-1, fp32) | tokens/s | s/step | all-to-all bytes/step (rank 0) | uniform formula |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        extra = (f"{row['all_to_all_bytes_per_step']:,.0f} | {row['uniform_formula_bytes']:,.0f}"
                 if "uniform_formula_bytes" in row else "- | -")
        print(f"| {name} | {row['tokens_per_s']:,.0f} | {row['s_per_step']:.3f} | {extra} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
