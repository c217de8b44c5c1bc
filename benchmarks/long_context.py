"""Long sequences: the longest sequence one training step fits at cp = 1, 2, 4 and with sparse vs dense attention.

Every measurement is one forward + backward of a small GPT (micro-batch 1, fp32, CPU, gloo) on cp local ranks,
each holding its two load-balanced chunks of the sequence (parallel/context). Memory is the real peak resident
memory of each rank's process during the step above its resting state (the model, its gradients and the
allocator's pages already touched): Linux's VmHWM, reset with /proc/self/clear_refs right before the step, minus
VmRSS at that moment. That is activations plus the step's temporaries, what grows with the sequence. A length
"fits" when the largest rank's peak stays within --budget-mb; lengths double from --min-len until one does not.

    python benchmarks/long_context.py [--budget-mb 256] [--cps 1 2 4] [--algorithm ring] [--sparse]

Tokens/s is the whole sequence's tokens over the step's wall time (on a shared 2-core CPU the cp > 1 runs
time-slice their ranks, so it measures the code path, not a speed-up). Prints markdown tables and JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megazoo.kernels import KernelChoice  # noqa: E402
from megazoo.models.presets import get_preset  # noqa: E402
from megazoo.models.transformer import GPT  # noqa: E402
from megazoo.models.weights import init_weights  # noqa: E402
from megazoo.parallel.context import split_sequence  # noqa: E402
from megazoo.workers.local import run_distributed  # noqa: E402
from megazoo.parallel.topology import Topology  # noqa: E402

MB = 2 ** 20


def model_config(max_len: int, attention: str = "dense", **sparse):
    """The benchmark's model: gpt2-tiny's width (d 128, 4 heads), 2 blocks, a small vocabulary."""
    return get_preset("gpt2-tiny").replace(n_layer=2, vocab_size=512, n_positions=max_len, dropout=0.0,
                                           attn_dropout=0.0, attention=attention, **sparse)


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so the next baseline is honest
    except OSError:
        pass


def measure_step(model: GPT, ids: torch.Tensor, topo: Topology) -> dict:
    """Peak memory above the resting state and wall time of one forward + backward on this rank's chunks."""
    inputs = split_sequence(ids[:, :-1], topo.cp, topo.cp_rank)
    targets = split_sequence(ids[:, 1:], topo.cp, topo.cp_rank)
    _trim()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    resting = _status("VmRSS")
    start = time.perf_counter()
    loss = model.loss(model(inputs), targets)
    loss.backward()
    elapsed = time.perf_counter() - start
    peak = _status("VmHWM") - resting
    del loss
    model.zero_grad(set_to_none=False)
    return {"peak_bytes": peak, "step_s": elapsed}


def _rank(cp: int, algorithm: str, lengths: list[int], attention: str, kernel: str, sparse: dict,
          budget: int) -> list[dict]:
    torch.set_num_threads(1)
    topo = Topology.build(1, cp=cp, cp_attention=algorithm) if cp > 1 else Topology.solo()
    cfg = model_config(max(lengths), attention, **sparse)
    model = GPT(cfg, topo, kernels=KernelChoice("auto", {"attention": kernel}))
    init_weights(model, 0)
    warm = torch.randint(0, cfg.vocab_size, (1, 2 * 2 * cp + 1), generator=torch.Generator().manual_seed(1))
    measure_step(model, warm, topo)  # gradients allocated: part of the resting state from now on
    rows = []
    for s in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, s + 1), generator=torch.Generator().manual_seed(s))
        row = measure_step(model, ids, topo)
        peaks = torch.zeros(cp, dtype=torch.int64)
        peaks[topo.cp_rank] = row["peak_bytes"]
        if cp > 1:
            torch.distributed.all_reduce(peaks)  # every rank learns every rank's peak: all stop together
        rows.append({"seq_len": s, "peak_mb_max_rank": int(peaks.max()) / MB, "step_s": row["step_s"],
                     "tokens_per_s": s / row["step_s"]})
        if int(peaks.max()) > budget:
            break
    return rows


def sweep(cp: int, algorithm: str, lengths: list[int], budget_mb: float, attention: str = "dense",
          kernel: str = "torch", sparse: dict | None = None) -> list[dict]:
    args = (cp, algorithm, lengths, attention, kernel, sparse or {}, int(budget_mb * MB))
    return _rank(*args) if cp == 1 else run_distributed(_rank, cp, *args)[0]


def longest(rows: list[dict], budget_mb: float) -> int:
    fits = [r["seq_len"] for r in rows if r["peak_mb_max_rank"] <= budget_mb]
    return max(fits) if fits else 0


def _table(title: str, runs: dict[str, list[dict]], budget_mb: float) -> None:
    print(f"\n{title} (budget {budget_mb:g} MB per rank above the resting state)\n")
    print("| run | longest seq within budget | seq_len: peak MB per rank (tokens/s) |")
    print("|---|---:|---|")
    for name, rows in runs.items():
        cells = ", ".join(f"{r['seq_len']}: {r['peak_mb_max_rank']:.0f} ({r['tokens_per_s']:.0f})" for r in rows)
        print(f"| {name} | {longest(rows, budget_mb)} | {cells} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=256.0)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=65536)
    parser.add_argument("--cps", type=int, nargs="*", default=[1, 2, 4], help="none: skip the cp table")
    parser.add_argument("--algorithm", choices=("all_to_all", "ring"), default="ring")
    parser.add_argument("--kernel", default="torch", help="dense attention kernel: torch (SDPA) | reference")
    parser.add_argument("--sparse", action="store_true", help="also: sparse vs dense attention at cp = 1")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    lengths = []
    s = args.min_len
    while s <= args.max_len:
        lengths.append(s)
        s *= 2
    results = {}
    cp_runs = {f"cp={cp} {args.algorithm if cp > 1 else ''} ({args.kernel})".replace("  ", " "):
               sweep(cp, args.algorithm, lengths, args.budget_mb, kernel=args.kernel) for cp in args.cps}
    if cp_runs:
        _table("Context parallelism", cp_runs, args.budget_mb)
        results["cp"] = cp_runs
    if args.sparse:
        sparse = {"sparse_block": 64, "sparse_local_blocks": 4, "sparse_global_blocks": 1}
        runs = {
            "dense, reference kernel (scores stored)": sweep(1, "ring", lengths, args.budget_mb, kernel="reference"),
            "dense, SDPA": sweep(1, "ring", lengths, args.budget_mb, kernel="torch"),
            "sparse sliding_window (64 x 4)": sweep(1, "ring", lengths, args.budget_mb, "sparse", sparse=dict(
                sparse, sparse_pattern="sliding_window")),
            "sparse bigbird (64 x 4, 1 global, 1 random)": sweep(1, "ring", lengths, args.budget_mb, "sparse",
                                                                 sparse=dict(sparse, sparse_pattern="bigbird",
                                                                             sparse_random_blocks=1)),
        }
        _table("Sparse vs dense attention (cp = 1)", runs, args.budget_mb)
        results["sparse"] = runs
    text = json.dumps(results)
    print("\n" + text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
