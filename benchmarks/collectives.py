"""gloo's own all-gather / reduce-scatter against the point-to-point exchange parallel/collectives.py uses for
large messages on gloo, and gloo's all-reduce of the same bytes (what torch DDP runs), side by side in one run.

    python -m benchmarks.collectives [--ranks 2] [--sizes-mb 1 4 16 64] [--repeat 5]

Per message size (the full tensor: the all-gather's output, the reduce-scatter's input): milliseconds per call on
rank 0 and the ratio gloo / exchange. Below collectives.P2P_MIN_BYTES the library keeps gloo's own collective.
"""

from __future__ import annotations

import argparse
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist

from megazoo.parallel import collectives
from megazoo.parallel.collectives import all_gather_flat, all_reduce, reduce_scatter_flat
from megazoo.workers.local import run_distributed


def _time(fn, repeat: int) -> float:
    fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / repeat * 1000


def worker(sizes_mb: list[float], repeat: int) -> list[dict]:
    size, group = dist.get_world_size(), dist.group.WORLD
    rows = []
    for mb in sizes_mb:
        n = int(mb * (1 << 20) / 4) // size * size
        full, piece = torch.randn(n), torch.empty(n // size)
        row = {"mb": mb, "all_reduce": _time(lambda: all_reduce(full, group), repeat)}
        for name, threshold in (("gloo", 1 << 62), ("exchange", 0)):
            with mock.patch.object(collectives, "P2P_MIN_BYTES", threshold):
                row[f"all_gather {name}"] = _time(lambda: all_gather_flat(full, piece, group), repeat)
                row[f"reduce_scatter {name}"] = _time(lambda: reduce_scatter_flat(piece, full, group), repeat)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    rows = run_distributed(worker, args.ranks, args.sizes_mb, args.repeat)[0]
    print(f"gloo, {args.ranks} ranks, fp32, ms per call (rank 0); exchange from "
          f"{collectives.P2P_MIN_BYTES / (1 << 20):g} MB in the library\n")
    print("| message MB | all-reduce (DDP) | all-gather gloo | all-gather exchange | gloo / exchange "
          "| reduce-scatter gloo | reduce-scatter exchange | gloo / exchange |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ag, rs = r["all_gather gloo"] / r["all_gather exchange"], r["reduce_scatter gloo"] / r["reduce_scatter exchange"]
        print(f"| {r['mb']:g} | {r['all_reduce']:.1f} | {r['all_gather gloo']:.1f} | {r['all_gather exchange']:.1f} "
              f"| {ag:.2f}x | {r['reduce_scatter gloo']:.1f} | {r['reduce_scatter exchange']:.1f} | {rs:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
