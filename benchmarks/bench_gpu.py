"""`make bench-gpu`: one-GPU training throughput, MFU, peak memory and loss, in one run of at most ~8 minutes on an H100.

    python -m benchmarks.bench_gpu [--models llama3.2-3b,gpt2-1.5b,llama3.2-1b] [--steps 10] [--budget-s 420]
                                   [--json runs/bench-gpu.json] [--no-kernels]

Per model (full fine-tune of the preset's shape on one GPU, random weights, a fixed random batch): the cases of
`cases()`: eager and compiled (train.compile = "blocks") bf16, compiled with activation checkpointing, and compiled
with each FP8 recipe (train.fp8); all with the fused head + loss (train.fused_loss). Each case is the training step
megazoo runs at zero.stage = 0 in bf16: fp32 parameters, bf16 autocast, AdamW (torch's fused) on fp32; its
micro-batch the largest the planner (recipes/planner/fit.max_micro_batch) fits in 90% of the GPU's memory (at most
MAX_MICRO_BATCH). Timed: `--steps` steps after WARMUP (compilation included in the warm-up, not in the time).

Printed: one markdown table and one JSON document (also written to --json): tokens/s, MFU by both FLOPs counts
(FORMULAS: causal attention, and the full-square count NVIDIA and models/flops.py quote) over the card's dense bf16
peak (recipes/gpus.py; FP8 rows too, so the speed-up reads directly), peak memory (torch.cuda.max_memory_allocated)
and the loss after the last step. Then benchmarks/kernels.py's per-op table (--no-kernels skips it).

Without a CUDA GPU of compute capability >= 8.0 and 40 GB it exits 2 saying what it found; FP8 rows need 8.9+
(Ada / Hopper / Blackwell) and are reported as skipped with the reason on older cards. Cases that would push the
run past --budget-s are skipped and listed, so the script always ends in time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megazoo.models.config import ModelConfig  # noqa: E402
from megazoo.models.presets import get_preset  # noqa: E402

MODELS = ("llama3.2-3b", "gpt2-1.5b", "llama3.2-1b")
SEQ_LEN = {"gpt2-1.5b": 1024, "llama3.2-1b": 2048, "llama3.2-3b": 2048}
WARMUP, MAX_MICRO_BATCH, MIN_MEMORY_GB = 3, 16, 40
FORMULAS = ("causal:     6 N + 6 L s h_q   per token (N: matmul parameters incl. the head; the scores and p v "
            "over the keys a causal query sees, s / 2 on average)",
            "non-causal: 6 N + 12 L s h_q  per token (the full square: NVIDIA's and models/flops.py's count)")


@dataclass(frozen=True)
class Case:
    model: str
    compiled: bool = True
    checkpointing: bool = False
    fp8: str = "none"

    @property
    def name(self) -> str:
        return (f"{self.model} {'compiled' if self.compiled else 'eager'}"
                f"{' +AC' if self.checkpointing else ''} {'bf16' if self.fp8 == 'none' else 'fp8-' + self.fp8}")


@dataclass
class Row:
    case: Case
    micro_batch: int = 0
    seq_len: int = 0
    tokens_per_s: float | None = None
    mfu_causal: float | None = None
    mfu_noncausal: float | None = None
    peak_memory_gb: float | None = None
    loss: float | None = None
    skipped: str = ""  # why the case did not run
    extra: dict = field(default_factory=dict)


def cases(models=MODELS) -> list[Case]:
    """Most informative first, since the time budget cuts from the end: every model compiled in bf16, then each
    FP8 recipe (Llama 3.2 3B, the issue's FP8 target, first in MODELS), then eager, then activation checkpointing."""
    return ([Case(m) for m in models] + [Case(m, fp8=r) for m in models for r in ("tensorwise", "rowwise")]
            + [Case(m, compiled=False) for m in models] + [Case(m, checkpointing=True) for m in models])


def flops_per_token(cfg: ModelConfig, seq_len: int, vocab: int, causal: bool) -> float:
    """Training FLOPs per token (FORMULAS): 6 x matmul parameters (blocks + head) + (6 or 12) x L x s x n_head hd."""
    from megazoo.models.flops import block_matmul_params
    n = cfg.n_layer * block_matmul_params(cfg) + vocab * cfg.d_model
    keys = min(seq_len, cfg.sliding_window) if cfg.sliding_window else seq_len
    return 6.0 * n + (6.0 if causal else 12.0) * cfg.n_layer * keys * cfg.n_head * cfg.head_dim


def fill_mfu(row: Row, cfg: ModelConfig, vocab: int, peak: float | None) -> Row:
    if row.tokens_per_s is None or not peak:
        return row
    row.mfu_causal = row.tokens_per_s * flops_per_token(cfg, row.seq_len, vocab, True) / peak
    row.mfu_noncausal = row.tokens_per_s * flops_per_token(cfg, row.seq_len, vocab, False) / peak
    return row


def table(rows: list[Row], device: str) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    num = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [f"| case ({device}) | micro-batch x seq | tokens/s | MFU causal | MFU non-causal | peak GB | loss |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.case.name} | - | skipped: {r.skipped} | | | | |")
            continue
        lines.append(f"| {r.case.name} | {r.micro_batch} x {r.seq_len} | {num(r.tokens_per_s, ',.0f')} | "
                     f"{pct(r.mfu_causal)} | {pct(r.mfu_noncausal)} | {num(r.peak_memory_gb, '.1f')} | "
                     f"{num(r.loss, '.4f')} |")
    return "\n".join(lines)


def gpu_problem(min_memory_gb: float = MIN_MEMORY_GB) -> str | None:
    """Why this machine cannot run the benchmark (None: it can)."""
    if not torch.cuda.is_available():
        return (f"bench-gpu needs a CUDA GPU; this machine has none (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'no'}). Run `make bench-gpu` on a GPU machine.")
    props = torch.cuda.get_device_properties(0)
    if (props.major, props.minor) < (8, 0):
        return f"bench-gpu needs bf16 tensor cores (compute capability >= 8.0); {props.name} is {props.major}.{props.minor}"
    if props.total_memory < min_memory_gb * 2**30:
        return f"bench-gpu needs >= {min_memory_gb} GB of GPU memory; {props.name} has {props.total_memory / 2**30:.0f} GB"
    return None


def fp8_problem() -> str | None:
    major, minor = torch.cuda.get_device_capability(0)
    return None if (major, minor) >= (8, 9) else f"FP8 needs compute capability 8.9+, this GPU is {major}.{minor}"


def planner_micro_batch(cfg: ModelConfig, seq_len: int, checkpointing: bool, capacity_gb: float,
                        fp8: str = "none") -> int:
    """The planner's largest micro-batch; FP8 rows their own (its copies counted, no 16-bit weight casts kept)."""
    from megazoo.recipes.planner.fit import Layout, max_micro_batch
    layout = Layout(dp=1, zero=0, micro_batch=1, seq_len=seq_len, checkpointing=checkpointing, precision="bf16",
                    flash_attention=True, fused_loss=True, fp8=fp8)
    return max_micro_batch(cfg, layout, 0.9 * capacity_gb, limit=MAX_MICRO_BATCH)


def run_case(case: Case, steps: int, capacity_gb: float) -> Row:
    from megazoo.models.transformer import GPT
    from megazoo.models.weights import init_weights
    from megazoo.parallel.tensor.fp8 import enable_fp8
    from megazoo.parallel.topology import Topology
    from megazoo.recipes.training.model_setup import compile_blocks

    cfg, seq = get_preset(case.model).replace(dropout=0.0, attn_dropout=0.0), SEQ_LEN[case.model]
    row = Row(case, seq_len=seq)
    row.micro_batch = planner_micro_batch(cfg, seq, case.checkpointing, capacity_gb, case.fp8)
    if row.micro_batch == 0:
        row.skipped = "does not fit at micro-batch 1 (planner)"
        return row
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model = GPT(cfg, Topology.solo(device), device=device, fused_loss=True,
                activation_checkpointing=case.checkpointing)
    init_weights(model, seed=0)
    if case.fp8 != "none":
        enable_fp8(model, case.fp8)
    if case.compiled:
        compile_blocks([model], "blocks")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (row.micro_batch, seq + 1), generator=gen).to(device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    try:
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    except torch.OutOfMemoryError as err:
        row.skipped = f"out of memory at micro-batch {row.micro_batch} ({str(err).splitlines()[0][:80]})"
        return row
    except Exception as err:  # one broken case (a compile failure, say) is reported, the others still run
        row.skipped = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        return row
    finally:
        del model, opt
    row.tokens_per_s = steps * row.micro_batch * seq / elapsed
    row.peak_memory_gb = torch.cuda.max_memory_allocated(device) / 2**30
    row.loss = loss.item()
    return row


def estimate_s(case: Case, steps: int, done: list[Row]) -> float:
    """A case's expected seconds: a finished case of the same model (compilation: +60 s), else a flat guess."""
    same = [r for r in done if r.case.model == case.model and r.extra.get("wall_s")]
    base = min((r.extra["wall_s"] for r in same), default=45.0)
    return base + (60.0 if case.compiled and not any(r.case.compiled for r in same) else 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting cases after this (the kernels "
                    "table then has the rest of the 8 minutes)")
    ap.add_argument("--json", default="runs/bench-gpu.json")
    ap.add_argument("--no-kernels", action="store_true")
    a = ap.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in SEQ_LEN:
            ap.error(f"--models: {m!r} is not benchmarked; valid: {', '.join(SEQ_LEN)}")
    if why := gpu_problem():
        print(why, file=sys.stderr)
        return 2
    from megazoo.recipes.gpus import peak_flops
    name = torch.cuda.get_device_name(0)
    capacity_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    peak = peak_flops(name, "bf16")
    no_fp8 = fp8_problem()
    torch.backends.cuda.matmul.allow_tf32 = True
    start, rows = time.perf_counter(), []
    for case in cases(models):
        if case.fp8 != "none" and no_fp8:
            rows.append(Row(case, skipped=no_fp8))
            continue
        if time.perf_counter() - start + estimate_s(case, a.steps, rows) > a.budget_s:
            rows.append(Row(case, skipped=f"time budget ({a.budget_s:.0f} s)"))
            continue
        t0 = time.perf_counter()
        row = run_case(case, a.steps, capacity_gb)
        row.extra["wall_s"] = time.perf_counter() - t0
        cfg = get_preset(case.model)
        rows.append(fill_mfu(row, cfg, cfg.padded_vocab(1), peak))
        print(f"{case.name}: {row.tokens_per_s or 0:,.0f} tokens/s {row.skipped}", file=sys.stderr, flush=True)
    print("\n".join(FORMULAS))
    print(f"peak: {name}, dense bf16 {peak / 1e12:.0f} TFLOP/s (recipes/gpus.py)" if peak else f"peak: {name} unknown")
    print(table(rows, name))
    doc = {"device": name, "peak_bf16_flops": peak, "formulas": FORMULAS, "steps": a.steps, "warmup": WARMUP,
           "torch": torch.__version__, "rows": [{**asdict(r), "case": {**asdict(r.case), "name": r.case.name}}
                                                 for r in rows]}
    print(json.dumps(doc))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=1))
    if not a.no_kernels:
        left = max(30.0, 470.0 - (time.perf_counter() - start))
        try:
            subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--skip-e2e"], check=False,
                           cwd=Path(__file__).resolve().parents[1], timeout=left)
        except subprocess.TimeoutExpired:
            print(f"benchmarks/kernels.py stopped after {left:.0f} s (the 8-minute budget)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
