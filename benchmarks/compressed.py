"""1-bit Adam and 0/1 Adam (parallel/compressed/) against AdamW: bytes per step, validation loss, and tokens/s
over a slow network. Prints JSON and a markdown table; never a timed test.

    python -m benchmarks.compressed                                 # both parts
    python -m benchmarks.compressed --part demo --steps 200         # the demo, shortened
    python -m benchmarks.compressed --part network --rates none,1gbit,100mbit   (root: network namespaces)

Part `demo`: recipes/demo.toml (gpt2-tiny on the stdlib corpus, dp=2) at ZeRO stage 0, shortened to --steps (lr
schedule over those steps), trained with AdamW, 1-bit Adam (freeze_step = 20 % of the steps, the papers' range
15-25 %) and 0/1 Adam (freeze_step = the lr warm-up, variance frozen at 50 %, local steps up to 8). Reports
the mean bytes per step each rank sends (CommLedger: the all-reduce as a ring sends it; the compressed
all-to-all and all-gather as they are), the reduction vs AdamW after the warm-up, and the validation loss.

Part `network`: two network namespaces joined by a veth pair, each end rate-limited with `tc ... tbf` (both
directions), one gloo rank in each (MASTER_ADDR on the veth, GLOO_SOCKET_IFNAME = its veth end). A model whose
step is dominated by communication (GPT 4 x 256, vocab 8192, 5.6 M parameters, one sequence of 64 tokens per
rank), AdamW vs 1-bit Adam vs 0/1 Adam (already past their warm-ups: only compressed steps are timed). The
namespaces are removed at the end, also on error or Ctrl-C. Without root or `ip netns`, it says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import netns

REPO = Path(__file__).resolve().parents[1]
PAIR = netns.VethPair(("mzc0", "mzc1"), ("mzc-veth0", "mzc-veth1"), "10.231.77")
OPTIMIZERS = ("adamw", "onebit_adam", "zero_one_adam")


# ---- part demo ---------------------------------------------------------------------------------------------------
def _demo_optimizer(name: str, steps: int, warmup: int) -> dict:
    if name == "onebit_adam":
        return {"name": name, "freeze_step": max(1, steps // 5)}
    if name == "zero_one_adam":
        return {"name": name, "freeze_step": max(1, steps // 5), "var_freeze_step": steps // 2,
                "var_update_scaler": 16, "local_step_scaler": max(1, steps // 20), "local_step_clipper": 4}
    return {"name": "adamw"}


def _demo_rank(steps: int, run_dir: str, names: tuple[str, ...]) -> dict:
    import torch

    from megazoo.parallel.topology import Topology
    from megazoo.recipes.config import load_recipe
    from megazoo.recipes.training.data_setup import load_data
    from megazoo.recipes.resolve import resolve
    from megazoo.recipes.training.trainer import Trainer

    warmup = 20
    sets = ["zero.stage=0", f"train.steps={steps}", f"train.warmup_steps={warmup}", "train.eval_every=0",
            "sample.tokens=0", f"run.dir={run_dir}", "logging.progress=false", "checkpoint.at_end=false"]
    out, data = {}, None
    for name in names:
        opt = _demo_optimizer(name, steps, warmup)
        res = resolve(load_recipe(REPO / "recipes" / "demo.toml", sets + [f"optimizer.{k}={json.dumps(v)}"
                                                                          for k, v in opt.items()]))
        topo = Topology.build(2, 1)
        torch.manual_seed(0)
        data = data or load_data(res, topo)
        trainer = Trainer(res, topo, data=data)
        start = time.perf_counter()
        records = [trainer.train_step(step) for step in range(steps)]
        elapsed = time.perf_counter() - start
        out[name] = {"settings": opt, "bytes": [r["comm_bytes"] for r in records],
                     "losses": [r["loss"] for r in records], "val_loss": trainer.evaluate(), "train_s": elapsed}
    return out


def part_demo(steps: int, names: tuple[str, ...] = OPTIMIZERS, baseline: dict | None = None) -> dict:
    """`baseline`: an earlier run's AdamW row (from --json) instead of training AdamW again."""
    from megazoo.workers.local import run_distributed

    with tempfile.TemporaryDirectory(prefix="megazoo-compressed-") as run_dir:
        result = run_distributed(_demo_rank, 2, steps, run_dir, names, timeout_s=7200)[0]
    rows = []
    for name in names:
        r = result[name]
        freeze = r["settings"].get("freeze_step", 0)
        after = r["bytes"][freeze:]
        rows.append({"optimizer": name, "settings": r["settings"], "mean_bytes_per_step": sum(r["bytes"]) / steps,
                     "bytes_per_step_after_warmup": sum(after) / len(after), "val_loss": r["val_loss"],
                     "final_train_loss_mean10": sum(r["losses"][-10:]) / 10, "train_s": r["train_s"],
                     "losses_every_50": r["losses"][::50]})
    base = baseline or next(row for row in rows if row["optimizer"] == "adamw")  # AdamW: the same bytes every step
    for row in rows:
        row["reduction_after_warmup"] = base["mean_bytes_per_step"] / max(row["bytes_per_step_after_warmup"], 1e-9)
        row["reduction_whole_run"] = base["mean_bytes_per_step"] / max(row["mean_bytes_per_step"], 1e-9)
        row["val_loss_vs_adamw"] = row["val_loss"] / base["val_loss"] - 1
    return {"steps": steps, "rows": ([base] if baseline else []) + rows}


def demo_markdown(out: dict) -> str:
    lines = [f"Demo (recipes/demo.toml at ZeRO stage 0, dp=2, shortened to {out['steps']} steps):", "",
             "| optimizer | MB/step/rank after warm-up | fewer bytes after warm-up | fewer bytes, whole run | "
             "validation loss | vs AdamW |", "|---|---:|---:|---:|---:|---:|"]
    for r in out["rows"]:
        lines.append(f"| {r['optimizer']} | {r['bytes_per_step_after_warmup'] / 1e6:.3f} | "
                     f"{r['reduction_after_warmup']:.1f}x | {r['reduction_whole_run']:.1f}x | {r['val_loss']:.4f} | "
                     f"{100 * r['val_loss_vs_adamw']:+.2f} % |")
    return "\n".join(lines)


# ---- part network ------------------------------------------------------------------------------------------------
def _network_worker(rank: int, optimizer: str, warm: int, timed: int, port: int) -> None:
    """One rank inside its namespace: the communication-bound GPT, `warm` untimed steps, then `timed` steps."""
    import torch

    from megazoo.workers.local import finish_worker
    from megazoo.parallel.topology import Topology, init_distributed
    from megazoo.recipes.config import Recipe, from_dict
    from megazoo.recipes.resolve import resolve
    from megazoo.recipes.training.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=PAIR.address(0), MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=PAIR.veths[rank])
    init_distributed(rank, 2, init_method="env://", device="cpu", timeout_s=600)
    opt = {"adamw": {}, "onebit_adam": {"name": "onebit_adam", "freeze_step": 2},
           "zero_one_adam": {"name": "zero_one_adam", "freeze_step": 1, "var_freeze_step": 2,
                             "local_step_scaler": 1, "local_step_clipper": 4}}[optimizer]
    table = {"model": {"preset": "gpt2-tiny", "n_layer": 4, "d_model": 256, "n_head": 4, "vocab_size": 8192,
                       "n_positions": 64, "dropout": 0.0, "attn_dropout": 0.0},
             "parallel": {"dp": 2, "timeout_s": 600}, "zero": {"stage": 0},
             "train": {"steps": warm + timed, "micro_batch": 1, "seq_len": 64, "precision": "fp32", "warmup_steps": 1},
             "optimizer": opt, "data": {"source": "synthetic", "synthetic_tokens": 20000},
             "logging": {"progress": False}, "checkpoint": {"at_end": False}, "sample": {"tokens": 0},
             "run": {"dir": tempfile.mkdtemp(prefix="megazoo-net-")}}
    res = resolve(from_dict(Recipe, table))
    trainer = Trainer(res, Topology.build(2, 1))
    for step in range(warm):
        trainer.train_step(step)
    start = time.perf_counter()
    records = [trainer.train_step(step) for step in range(warm, warm + timed)]
    elapsed = time.perf_counter() - start
    if rank == 0:
        params = sum(p.numel() for p in trainer.model.parameters())
        print(json.dumps({"optimizer": optimizer, "tokens_per_s": timed * res.tokens_per_step / elapsed,
                          "step_s": elapsed / timed, "bytes_per_step": sum(r["comm_bytes"] for r in records) / timed,
                          "params": params}), flush=True)
    finish_worker(0)


def _run_pair(optimizer: str, warm: int, timed: int, port: int) -> dict:
    procs = []
    for rank, ns in enumerate(PAIR.namespaces):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "benchmarks.compressed", "--worker", str(rank),
               "--optimizer", optimizer, "--warm", str(warm), "--timed", str(timed), "--port", str(port)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"network run {optimizer} failed:\n" + "\n".join(err[-2000:] for _, err in outs))
    return json.loads(outs[0][0].strip().splitlines()[-1])


def part_network(rates: list[str], warm: int, timed: int) -> dict:
    why_not = netns.missing_privileges()
    if why_not:
        return {"error": f"{why_not}; bytes only (part demo)"}
    rows, port = [], 29731
    try:
        with netns.namespaces(PAIR):
            for rate in rates:
                netns.set_rate(PAIR, rate)
                for optimizer in OPTIMIZERS:
                    port += 1
                    rows.append({"rate": rate, **_run_pair(optimizer, warm, timed, port)})
                    print(json.dumps(rows[-1]), flush=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        return {"error": f"cannot create the namespaces ({detail.strip()}): bytes only (part demo)", "rows": rows}
    return {"rows": rows, "warm_steps": warm, "timed_steps": timed, "load_average": os.getloadavg()}


def network_markdown(out: dict) -> str:
    if "error" in out:
        return f"Slow network: {out['error']}"
    lines = [f"Slow network (dp=2 over a tc-limited veth pair, {out['rows'][0]['params'] / 1e6:.1f} M-parameter GPT, "
             f"{out['timed_steps']} timed steps; load average {out['load_average'][0]:.1f}):", "",
             "| link | optimizer | MB/step/rank | s/step | tokens/s | vs AdamW |", "|---|---|---:|---:|---:|---:|"]
    base = {r["rate"]: r["tokens_per_s"] for r in out["rows"] if r["optimizer"] == "adamw"}
    for r in out["rows"]:
        lines.append(f"| {r['rate']} | {r['optimizer']} | {r['bytes_per_step'] / 1e6:.2f} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base[r['rate']]:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "demo", "network"), default="all")
    parser.add_argument("--steps", type=int, default=200, help="demo steps (the full demo is 600)")
    parser.add_argument("--rates", default="none,1gbit,100mbit")
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--timed", type=int, default=6)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--only", help="demo: these optimizers (comma-separated) ...")
    parser.add_argument("--baseline", help="... and AdamW's row from this earlier --json output")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _network_worker(args.worker, args.optimizer, args.warm, args.timed, args.port)
    results = {}
    if args.part in ("all", "network"):
        results["network"] = part_network(args.rates.split(","), args.warm, args.timed)
        print(network_markdown(results["network"]), flush=True)
    if args.part in ("all", "demo"):
        names = tuple(args.only.split(",")) if args.only else OPTIMIZERS
        baseline = None
        if args.baseline:
            baseline = next(r for r in json.loads(Path(args.baseline).read_text())["demo"]["rows"]
                            if r["optimizer"] == "adamw")
        results["demo"] = part_demo(args.steps, names, baseline)
        print(demo_markdown(results["demo"]), flush=True)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
