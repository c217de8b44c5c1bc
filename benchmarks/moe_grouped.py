"""The routed experts on this machine: one grouped matmul (torch._grouped_mm) against the per-expert loop, in
tokens/s of one training pass (forward and backward), at 8, 64 and 128 experts, one table in one run.

    python -m benchmarks.moe_grouped                      # 2,048 tokens, top-2, d_model 512, expert width 256
    python -m benchmarks.moe_grouped --experts 8 64 128 --top-k 8 --json out.json

Both paths are models/moe/experts.py's, on the same rows: `tokens x top_k` rows of d_model sorted by expert with
balanced counts (what a load-balanced router hands the experts), fp32 and bf16 weights (n, 2 f, d) and (n, d, f).
Each cell is the median of `--repeats` timed passes after one warm-up. The loop runs one small SwiGLU per expert
(reading the counts on the host); the grouped path runs each of the two matmuls once over all experts, so its
advantage grows with the number of experts (fewer rows per expert: more, smaller matmuls for the loop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megazoo.models.moe.experts import grouped_mm_unsupported, grouped_swiglu, looped_swiglu  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def balanced_counts(rows: int, experts: int) -> torch.Tensor:
    """Rows per expert as even as they divide (the first rows % experts experts one more)."""
    return torch.tensor([rows // experts + (e < rows % experts) for e in range(experts)], dtype=torch.int64)


def time_pass(fn, tokens, counts, w_fc, w_proj, repeats: int) -> float:
    """Median seconds of forward + backward (gradients of the tokens and both weights)."""
    def once() -> float:
        for t in (tokens, w_fc, w_proj):
            t.grad = None
        start = time.perf_counter()
        fn(tokens, counts, w_fc, w_proj).float().square().mean().backward()
        return time.perf_counter() - start
    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def measure(experts: int, args, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    rows = args.tokens * args.top_k
    d, f = args.d_model, args.d_ff
    tokens = torch.randn(rows, d, dtype=dtype, requires_grad=True)
    w_fc = (torch.randn(experts, 2 * f, d) * d ** -0.5).to(dtype).requires_grad_()
    w_proj = (torch.randn(experts, d, f) * f ** -0.5).to(dtype).requires_grad_()
    counts = balanced_counts(rows, experts)
    why = grouped_mm_unsupported(dtype, d, f)
    if why:
        raise SystemExit(f"moe_grouped: {why}")
    with torch.no_grad():  # the two paths compute the same thing (tests/models/moe/test_moe_block.py holds it)
        gap = (grouped_swiglu(tokens, counts, w_fc, w_proj) - looped_swiglu(tokens, counts, w_fc, w_proj)).abs().max()
    grouped = time_pass(grouped_swiglu, tokens, counts, w_fc, w_proj, args.repeats)
    loop = time_pass(looped_swiglu, tokens, counts, w_fc, w_proj, args.repeats)
    return {"experts": experts, "dtype": str(dtype).removeprefix("torch."), "rows_per_expert": rows / experts,
            "grouped_tokens_per_s": args.tokens / grouped, "loop_tokens_per_s": args.tokens / loop,
            "grouped_over_loop": loop / grouped, "max_abs_difference": float(gap)}


def table(rows: list[dict], args) -> str:
    lines = [f"routed experts, forward + backward of {args.tokens:,} tokens x top-{args.top_k}, d_model "
             f"{args.d_model}, expert width {args.d_ff}, {torch.get_num_threads()} thread(s), torch {torch.__version__}",
             "", "| experts | dtype | rows / expert | grouped tokens/s | loop tokens/s | grouped / loop |",
             "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['experts']} | {r['dtype']} | {r['rows_per_expert']:,.0f} | {r['grouped_tokens_per_s']:,.0f} | "
              f"{r['loop_tokens_per_s']:,.0f} | {r['grouped_over_loop']:.2f}x |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64, 128])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = [measure(e, args, DTYPES[name]) for name in args.dtypes for e in args.experts]
    print(table(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
