"""Peak memory of the head + loss, plain (logits, then the vocab-parallel cross-entropy) vs fused
(parallel/tensor/linear_cross_entropy.py), forward and backward, measured by torch's MemTracker (live tensor storage).

    python benchmarks/fused_loss.py [--tokens 512] [--d-model 4096] [--vocab 128256] [--dtype bf16] [--device cpu]

Prints JSON and a markdown table: the peak of each path above what exists before (h, W and their gradients
counted once both paths have them), and the planner's last-stage terms for the same shapes. Llama 3's vocabulary
at d = 4096 (Llama 3.1 8B); on CPU a few hundred tokens, on a GPU 8K.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from megazoo.parallel.tensor import vocab_parallel_cross_entropy
from megazoo.parallel.tensor.linear_cross_entropy import chunk_rows_for, linear_cross_entropy

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _peak(fn, tensors) -> int:
    tracker = MemTracker()
    tracker.track_external(*tensors)
    with tracker:
        fn()
    return max(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())


def measure(tokens: int, d_model: int, vocab: int, dtype: torch.dtype, device: str = "cpu",
            chunk_rows: int | None = None) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(tokens, d_model, generator=gen, device=device) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(vocab, d_model, generator=gen, device=device) * 0.02).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    weight = torch.full((tokens,), 1.0 / tokens, device=device)
    losses = {}

    def plain():
        h.grad = w.grad = None
        loss = vocab_parallel_cross_entropy(h @ w.t(), target, None, vocab).mean()
        loss.backward()
        losses["plain"] = loss.item()

    def fused():
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, target, weight, None, vocab, chunk_rows=chunk_rows)
        loss.backward()
        losses["fused"] = loss.item()

    base = _peak(lambda: None, (h, w, target, weight))
    out = {"tokens": tokens, "d_model": d_model, "vocab": vocab, "dtype": str(dtype).split(".")[-1],
           "device": device, "inputs_bytes": base, "chunk_rows": chunk_rows or chunk_rows_for(tokens, vocab)}
    for name, fn in (("plain", plain), ("fused", fused)):
        fn()  # warm-up: the gradients' storage exists from here on, for both alike
        out[f"{name}_peak_bytes"] = _peak(fn, (h, w, target, weight)) - base
    out["loss_plain"], out["loss_fused"] = losses["plain"], losses["fused"]
    out["grad_bytes"] = torch.finfo(dtype).bits // 8
    out["logits_bytes"] = tokens * vocab * out["grad_bytes"]
    out["saved"] = 1 - out["fused_peak_bytes"] / out["plain_peak_bytes"]
    return out


def table(r: dict) -> str:
    mib = 2 ** 20
    return "\n".join([
        f"| head + loss, {r['tokens']} tokens x V {r['vocab']:,} x d {r['d_model']} ({r['dtype']}, {r['device']}) "
        "| peak above inputs (MiB) |", "|---|---:|",
        f"| plain (logits + vocab-parallel CE) | {r['plain_peak_bytes'] / mib:,.1f} |",
        f"| fused (chunked linear + CE, {r['chunk_rows']} tokens a chunk) | {r['fused_peak_bytes'] / mib:,.1f} |",
        f"| dW, one weight-sized gradient (both paths) | {r['vocab'] * r['d_model'] * r['grad_bytes'] / mib:,.1f} |",
        f"| one copy of the logits | {r['logits_bytes'] / mib:,.1f} |"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk-rows", type=int, default=None, help="tokens per chunk (default: chunk_rows_for's)")
    a = ap.parse_args(argv)
    r = measure(a.tokens, a.d_model, a.vocab, DTYPES[a.dtype], a.device, a.chunk_rows)
    print(json.dumps(r))
    print(table(r))


if __name__ == "__main__":
    main()
