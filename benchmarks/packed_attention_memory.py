"""Peak memory of packed rows' attention: the dense block-diagonal mask it used to take vs the variable-length path
(models/packing.py), beside padding (one example per row of s tokens, plain causal attention).

    python benchmarks/packed_attention_memory.py [--seq-len 4096 8192] [--heads 8] [--head-dim 64] [--json F]

One row of s tokens holds examples of 64-512 tokens (seeded) until it is full. Each mode runs the attention's
forward and backward in a fresh process (fp32, CPU) and reports the growth of that process's peak resident set
(ru_maxrss) over its peak just before: the memory the attention itself needed at its worst moment, mask and
scores included, measured by the OS rather than derived. Prints JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch, torch.nn.functional as F
from megazoo.models.packing import Segments
torch.set_num_threads(1)
mode, s, h, hd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
gen = torch.Generator().manual_seed(0)
lengths, total = [], 0
while total < s:
    n = min(int(torch.randint(64, 513, (1,), generator=gen)), s - total)
    lengths.append(n)
    total += n
ids = torch.cat([torch.full((1, n), i + 1) for i, n in enumerate(lengths)], dim=1)
rows = len(lengths) if mode == "padded" else 1
q, k, v = (torch.randn(rows, h, s, hd, generator=gen).requires_grad_() for _ in range(3))
grad = torch.randn(rows, h, s, hd, generator=gen)
small = torch.randn(1, 1, 8, 8, requires_grad=True)
F.scaled_dot_product_attention(small, small, small, is_causal=True).sum().backward()  # kernels loaded
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if mode == "dense":
    seg = Segments.from_ids(ids)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.dense_mask())
elif mode == "varlen":
    y = Segments.from_ids(ids).attend(q, k, v)
else:
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
y.backward(grad)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"mode": mode, "examples": len(lengths), "rows": rows, "peak_mib": (after - before) / 1024,
                  "qkv_mib": 3 * q.numel() * 4 / 2**20}))
"""


def measure(mode: str, seq_len: int, heads: int, head_dim: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(seq_len), str(heads), str(head_dim)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    for s in args.seq_len:
        row = {"seq_len": s}
        for mode in ("dense", "varlen", "padded"):
            row[mode] = measure(mode, s, args.heads, args.head_dim)
            print(json.dumps({"seq_len": s, **row[mode]}), file=sys.stderr, flush=True)  # progress
        results.append(row)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print()
    print(f"| s | examples | dense mask (MiB) | variable-length (MiB) | padded, one example per row (MiB) |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['seq_len']} | {r['dense']['examples']} | {r['dense']['peak_mib']:.0f} | "
              f"{r['varlen']['peak_mib']:.0f} | {r['padded']['peak_mib']:.0f} ({r['padded']['rows']} rows) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
