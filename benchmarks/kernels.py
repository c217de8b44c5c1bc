"""Every kernel implementation side by side, and gpt2-1.5b training per `kernels.prefer`.

    python -m benchmarks.kernels                        # all ops, both shape sets, end to end
    python -m benchmarks.kernels --ops layer_norm,cross_entropy --skip-e2e --json out.json

Part 1, ops: each op's implementations that run on this device, at GPT-2 1.5B and T-NLG 17B per-GPU shapes (bf16;
tp = 1, 8 x 1024 resp. 4 x 1024 tokens), forward and forward + backward. Memory-bound ops report achieved GB/s
(the bytes a perfect kernel must move, over the time) against the measured copy bandwidth; attention reports
TFLOP/s (causal: half the s^2 work) against the measured bf16 matmul rate. The cross-entropy also reports its
peak extra memory (the reference keeps an fp32 copy of the logits; the fused ones must not).

Part 2, end to end: gpt2-1.5b, one GPU, bf16 parameters with fp32 master copies and AdamW on them (ZeRO's flat
fp32 chunks at dp = 1), for each prefer setting: tokens/s and MFU = tokens/s x model FLOPs per token
(flops_per_token) over the measured bf16 matmul ceiling.

Without CUDA it runs small shapes on the CPU (fp32 end to end) so the script is exercised, and says that the
GPU targets were not measured. Interpreted Triton (TRITON_INTERPRET=1) is never timed.
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

from megazoo.kernels import OPS, PREFER, KernelChoice, KernelError, resolve_kernels  # noqa: E402
from megazoo.kernels.availability import triton_interpreted  # noqa: E402
from megazoo.kernels.dispatch import REGISTRY  # noqa: E402
from megazoo.models.config import ModelConfig
from megazoo.models.presets import get_preset  # noqa: E402
from megazoo.models.transformer import GPT  # noqa: E402
from megazoo.models.weights import init_weights  # noqa: E402
from megazoo.parallel.topology import Topology  # noqa: E402

GB = 1e9


def shapes(cuda: bool) -> dict[str, dict]:
    """Per-GPU op shapes (tp = 1): tokens = micro-batch x sequence."""
    full = {"gpt2-1.5b": (get_preset("gpt2-1.5b"), 8), "tnlg-17b": (get_preset("tnlg-17b"), 4)}
    out = {}
    for name, (cfg, batch) in full.items():
        seq, vocab = cfg.n_positions, cfg.padded_vocab(1)
        d, heads, d_ff = cfg.d_model, cfg.n_head, cfg.d_ff
        if not cuda:  # CPU: same head size, 1/8 of the heads, 1/8 of the sequence, 1/16 of the vocabulary
            batch, seq, heads, vocab = 2, 128, max(1, heads // 8), vocab // 16
            d, d_ff = heads * cfg.head_dim, 4 * heads * cfg.head_dim
        out[name] = dict(batch=batch, seq=seq, tokens=batch * seq, d=d, heads=heads, d_ff=d_ff, vocab=vocab)
    return out


# ---- timing and ceilings ---------------------------------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup: int = 3, reps: int = 10) -> float:
    """Median seconds of fn() (CUDA events on a GPU, perf_counter on CPU, where a smoke run is enough)."""
    if device.type != "cuda":
        warmup, reps = 1, 3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(device, dtype) -> dict:
    """Measured, not quoted: device-to-device copy bandwidth and dense matmul rate in `dtype`."""
    cuda = device.type == "cuda"
    n = (1 << 28) if cuda else (1 << 24)  # 512 MiB / 32 MiB of bf16-sized elements
    src = torch.empty(n, dtype=torch.float16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device)
    m = 8192 if cuda else 1024
    a, b = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(2))
    mm_s = timed(lambda: a @ b, device, warmup=2, reps=5)
    return {"bandwidth_GBps": 2 * n * 2 / copy_s / GB, "matmul_TFLOPs": 2 * m ** 3 / mm_s / 1e12,
            "matmul_dtype": str(dtype).replace("torch.", "")}


# ---- per-op cases ----------------------------------------------------------------------------------------------
def op_case(op: str, s: dict, device, dtype):
    """(make inputs, call(fn, inputs), bytes forward, bytes fwd+bwd, flops fwd, flops fwd+bwd) for one op."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dt=dtype, grad=True):
        return torch.randn(*shape, device=device, dtype=dt, generator=g).requires_grad_(grad)

    e = torch.finfo(dtype).bits // 8
    t, d, f = s["tokens"], s["d"], s["d_ff"]
    if op == "layer_norm":
        return (lambda: (rand(t, d), rand(d), rand(d)), lambda fn, x: fn(x[0], x[1], x[2], 1e-5),
                2 * t * d * e, 5 * t * d * e, 0, 0)
    if op == "bias_gelu":
        return (lambda: (rand(t, f), rand(f)), lambda fn, x: fn(x[0], x[1]), 2 * t * f * e, 5 * t * f * e, 0, 0)
    if op == "attention":
        b, h, sq, hd = s["batch"], s["heads"], s["seq"], s["d"] // s["heads"]
        flops = 4 * b * h * sq * sq * hd / 2  # QK^T and PV, causal half
        return (lambda: tuple(rand(b, h, sq, hd) for _ in range(3)), lambda fn, x: fn(*x, 0.0), 0, 0, flops,
                3.5 * flops)
    if op == "cross_entropy":
        v = s["vocab"]
        target = torch.randint(0, v, (t,), device=device, generator=g)
        return (lambda: (rand(t, v), target), lambda fn, x: fn(x[0], x[1], None, v), t * v * e, 3 * t * v * e, 0, 0)
    if op == "adamw":
        n = (1 << 26) if device.type == "cuda" else (1 << 20)  # 67 M fp32 elements: a slice of ZeRO's chunks
        return (lambda: [rand(n // 4 + i, dt=torch.float32, grad=False) for i in range(4)], None, 0, 7 * 4 * n, 0, 0)
    raise ValueError(op)


def bench_op(op: str, impl, s: dict, device, dtype, ceil: dict) -> dict:
    make, call, bytes_f, bytes_fb, flops_f, flops_fb = op_case(op, s, device, dtype)
    row = {"op": op, "impl": impl.name}
    if op == "adamw":
        masters = make()
        for m in masters:
            m.grad = torch.randn_like(m) * 1e-3
        opt = impl.fn([{"params": masters, "weight_decay": 0.1}], lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
        row["fwd_ms"], row["fwd_bwd_ms"] = None, 1e3 * timed(opt.step, device)
    else:
        inputs = make()
        out = call(impl.fn, inputs)
        grad_out = torch.randn_like(out)

        def fwd():
            with torch.no_grad():
                call(impl.fn, inputs)

        def fwd_bwd():
            call(impl.fn, inputs).backward(grad_out)

        row["fwd_ms"] = 1e3 * timed(fwd, device)
        if device.type == "cuda":
            del out
            sync(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        row["fwd_bwd_ms"] = 1e3 * timed(fwd_bwd, device, warmup=1, reps=5)
        if device.type == "cuda":
            row["peak_extra_MB"] = (torch.cuda.max_memory_allocated(device) - base) / 1e6
    for key, amount, ms in (("fwd", bytes_f or flops_f, row["fwd_ms"]), ("fwd_bwd", bytes_fb or flops_fb,
                                                                          row["fwd_bwd_ms"])):
        if ms is None or not amount:
            continue
        if bytes_f or bytes_fb:
            rate = amount / (ms / 1e3) / GB
            row[f"{key}_GBps"], row[f"{key}_pct"] = rate, 100 * rate / ceil["bandwidth_GBps"]
        else:
            rate = amount / (ms / 1e3) / 1e12
            row[f"{key}_TFLOPs"], row[f"{key}_pct"] = rate, 100 * rate / ceil["matmul_TFLOPs"]
    return row


def runnable(op: str, device) -> list:
    """Implementations of `op` that run here and are worth timing (interpreted Triton is not)."""
    out = []
    for candidate in REGISTRY[op]:
        if candidate.missing(device) is None and not (candidate.name == "triton" and triton_interpreted()):
            out.append(resolve_kernels(KernelChoice(overrides={op: candidate.name}), device)[op])
    return out


# ---- end to end ------------------------------------------------------------------------------------------------
def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward matmuls) plus attention scores and values,
    12 n_layer d seq (PaLM's convention, no causal discount). Recomputation is not counted (MFU, not HFU)."""
    return 6 * cfg.num_parameters() + 12 * cfg.n_layer * cfg.d_model * seq


def train_throughput(prefer: str, device, steps: int, micro_batch: int, cuda: bool, checkpointing: bool) -> dict:
    cfg = get_preset("gpt2-1.5b") if cuda else get_preset("gpt2-tiny").replace(vocab_size=4096)  # the demo's
    cfg = cfg.replace(dropout=0.0, attn_dropout=0.0)
    seq = cfg.n_positions if cuda else 128
    dtype = torch.bfloat16 if cuda else torch.float32
    kernels = resolve_kernels(KernelChoice(prefer), device)
    if any(k.name == "triton" for k in kernels.values()) and triton_interpreted():
        return {"prefer": prefer, "skipped": "Triton is interpreted (TRITON_INTERPRET=1): not timed"}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = GPT(cfg, Topology.solo(device), kernels=kernels, activation_checkpointing=checkpointing, device=device,
                dtype=dtype)
    init_weights(model, 0)
    params = [p for p in model.parameters()]
    # fp32 masters, one flat tensor per weight-decay group (ZeRO's owned chunks at dp = 1)
    groups = [[p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]]
    masters = [torch.cat([p.detach().float().flatten() for p in group]) for group in groups]
    opt = kernels["adamw"].fn([{"params": [masters[0]], "weight_decay": 0.1},
                               {"params": [masters[1]], "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), device=device)

    def step():
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        with torch.no_grad():
            for master, group in zip(masters, groups):
                master.grad = torch.cat([p.grad.float().flatten() for p in group])
            opt.step()
            for master, group in zip(masters, groups):
                torch._foreach_copy_([p for p in group], [m.view_as(p) for m, p in
                                                          zip(master.split([p.numel() for p in group]), group)])
                for p in group:
                    p.grad = None
        return loss

    step_s = timed(step, device, warmup=2, reps=steps)
    tok_s = micro_batch * seq / step_s
    return {"prefer": prefer, "model": cfg.name, "micro_batch": micro_batch, "seq": seq,
            "kernels": {op: k.name for op, k in kernels.items()}, "step_s": step_s, "tokens_per_s": tok_s,
            "model_TFLOPs": tok_s * flops_per_token(cfg, seq) / 1e12,
            "peak_memory_GB": torch.cuda.max_memory_allocated(device) / GB if cuda else None}


# ---- main ------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: all)")
    parser.add_argument("--skip-e2e", action="store_true", help="only the per-op part")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per prefer setting")
    parser.add_argument("--micro-batch", type=int, default=4, help="end-to-end micro-batch (sequences)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="end to end: recompute blocks in backward (the unfused attention paths keep (s, s) "
                             "scores per layer otherwise)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    ceil = ceilings(device, dtype)
    print(f"# kernels benchmark on {name} ({device.type})")
    if not cuda:
        print("NOTE: no CUDA device: small CPU shapes in fp32 only. The GPU targets (GPT-2 1.5B / T-NLG shapes in "
              "bf16, gpt2-1.5b tokens/s and MFU) were NOT measured.")
    print(f"measured ceilings: copy {ceil['bandwidth_GBps']:.0f} GB/s, {ceil['matmul_dtype']} matmul "
          f"{ceil['matmul_TFLOPs']:.3g} TFLOP/s\n")
    results = {"device": name, "ceilings": ceil, "ops": [], "e2e": []}
    for shape_name, s in shapes(cuda).items():
        print(f"## {shape_name}: tokens {s['tokens']}, d {s['d']}, heads {s['heads']}, d_ff {s['d_ff']}, "
              f"vocab {s['vocab']}, {str(dtype).replace('torch.', '')}\n")
        print("| op | impl | fwd ms | fwd+bwd ms | fwd rate | fwd+bwd rate | unit | fwd+bwd % of ceiling "
              "| peak extra MB |")
        print("|---|---|---:|---:|---:|---:|---|---:|---:|")
        for op in args.ops.split(","):
            for impl in runnable(op, device):
                try:
                    row = bench_op(op, impl, s, device, dtype, ceil)
                except (RuntimeError, TypeError) as exc:  # e.g. out of memory, a dtype a kernel does not take
                    print(f"| {op} | {impl.name} | failed: {str(exc).splitlines()[0][:80]} |||||||")
                    continue
                unit = "TFLOPs" if "fwd_bwd_TFLOPs" in row else "GBps"
                fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
                print(f"| {op} | {impl.name} | {fmt(row['fwd_ms'])} | {fmt(row['fwd_bwd_ms'])} | "
                      f"{fmt(row.get('fwd_' + unit))} | {fmt(row.get('fwd_bwd_' + unit))} | {unit.replace('ps', '/s')}"
                      f" | {fmt(row.get('fwd_bwd_pct'))} | {fmt(row.get('peak_extra_MB'))} |")
                results["ops"].append({"shape": shape_name, **row})
                if cuda:
                    torch.cuda.empty_cache()
        print()
    if not args.skip_e2e:
        print(f"## end to end: {'gpt2-1.5b, one GPU, bf16' if cuda else 'gpt2-tiny on CPU, fp32 (stand-in)'}\n")
        print("| prefer | kernels | step s | tokens/s | model TFLOP/s | MFU % | peak GB |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for prefer in PREFER:
            try:
                row = train_throughput(prefer, device, args.steps, args.micro_batch if cuda else 2, cuda,
                                       args.activation_checkpointing)
            except (KernelError, RuntimeError) as exc:
                row = {"prefer": prefer, "skipped": str(exc).splitlines()[0]}
            if "skipped" in row:
                print(f"| {prefer} | not run: {row['skipped'][:100]} ||||||")
            else:
                row["mfu_pct"] = 100 * row["model_TFLOPs"] / ceil["matmul_TFLOPs"]
                used = ",".join(f"{op}={name}" for op, name in row["kernels"].items())
                peak = "-" if row["peak_memory_GB"] is None else f"{row['peak_memory_GB']:.1f}"
                print(f"| {prefer} | {used} | {row['step_s']:.3f} | {row['tokens_per_s']:.0f} | "
                      f"{row['model_TFLOPs']:.2f} | {row['mfu_pct']:.1f} | {peak} |")
            results["e2e"].append(row)
            if cuda:
                torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
