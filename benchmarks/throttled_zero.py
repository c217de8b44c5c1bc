"""ZeRO across two "nodes" with a throttled inter-node link: flat ZeRO-3, HSDP, hpZ, hpZ + qwZ, hpZ + qwZ + qgZ
(int4), 1-bit Adam and 0/1 Adam (ZeRO stages 0 and 1), tokens/s and bytes per link class. Prints JSON and a markdown table; never a timed test.

    python -m benchmarks.throttled_zero                                  (root: network namespaces)
    python -m benchmarks.throttled_zero --rates 100mbit,1gbit --rounds 2 --warm 3 --timed 3 --json out.json

Two network namespaces (benchmarks/netns.py) are the two nodes, joined by a veth pair whose ends are limited to
the inter-node rate with `tc ... tbf`; the two processes inside one namespace talk over its own address, which
never leaves through the veth (the unthrottled intra-node link). One torchrun per namespace
(`torchrun --nnodes 2 --nproc-per-node 2 --node-rank i`, rendezvous on node 0's veth address,
GLOO_SOCKET_IFNAME = the namespace's veth end) starts 2 x 2 gloo ranks: dp 4, parallel.node_size 2.

Each rate is one launch, and one interleaved run inside it: every rank builds one Trainer per layout (same
model, same seed, same synthetic data), runs --warm untimed steps of each (1-bit Adam's freeze_step lies inside
them, so only compressed steps are timed), then --rounds rounds of every layout in turn, --timed steps each per
round, so load from other users of the machine falls on every layout alike. The model is communication-bound
(GPT 4 x 256, vocab 8192, 5.6 M parameters, fp32, one sequence of 64 tokens per rank). Bytes per step per rank
come from the trainer's CommLedger (`zero.comm.link_bytes`: a collective over a group inside one node counts as
intra, one whose group spans nodes counts all its ring bytes as inter). The namespaces are removed at the end,
also on error or Ctrl-C; without root it says so and exits 2.
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
PAIR = netns.VethPair(("mzz0", "mzz1"), ("mzz-veth0", "mzz-veth1"), "10.231.78")
NODES, PER_NODE = 2, 2
RESULT_TAG = "THROTTLED_ZERO_RESULT "
# 0/1 Adam: AdamW for steps 0-1, variance frozen from step 3, local steps from there (sync every 1, 2, 4 steps, at
# most 4 apart), so every timed step is in that phase. freeze_step 1 / var_freeze_step 2 (benchmarks/compressed.py's
# network settings) diverged on this model (loss 9 -> 31 at step 3); these keep it near AdamW's (measured, 12 steps)
ZERO_ONE = {"name": "zero_one_adam", "freeze_step": 2, "var_freeze_step": 3, "local_step_scaler": 1,
            "local_step_clipper": 4}
# name -> (zero section, optimizer section); the first is the baseline the ratios divide by.
LAYOUTS: dict[str, tuple[dict, dict]] = {
    "flat-zero3": ({"stage": 3}, {}),
    "hsdp-zero3": ({"stage": 3, "shard_group": "node"}, {}),
    "hpz": ({"stage": 3, "hpz": True}, {}),
    "hpz+qwz": ({"stage": 3, "hpz": True, "quantized_weights": True}, {}),
    "hpz+qwz+qgz": ({"stage": 3, "hpz": True, "quantized_weights": True, "quantized_gradients": "int4"}, {}),
    "onebit-zero0": ({"stage": 0}, {"name": "onebit_adam", "freeze_step": 2}),
    "onebit-zero1": ({"stage": 1}, {"name": "onebit_adam", "freeze_step": 2}),
    "zeroone-zero0": ({"stage": 0}, ZERO_ONE),
    "zeroone-zero1": ({"stage": 1}, ZERO_ONE),
}
BASELINE = "flat-zero3"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: rates tc can read, known layouts, positive step counts (SystemExit 2 else)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100mbit,1gbit", help=f"inter-node rates, comma-separated: {netns.RATE_HELP}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all layouts per rate")
    parser.add_argument("--warm", type=int, default=3, help="untimed steps per layout (past 1-bit Adam's warm-up)")
    parser.add_argument("--timed", type=int, default=3, help="timed steps per layout per round")
    parser.add_argument("--port", type=int, default=29811, help="rendezvous port (rate i uses port + i)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the launch, under torchrun
    args = parser.parse_args(argv)
    try:
        args.rates = [netns.check_rate(r.strip()) for r in args.rates.split(",") if r.strip()]
    except ValueError as err:
        parser.error(f"--rates: {err}")
    if not args.rates:
        parser.error(f"--rates is empty; valid: {netns.RATE_HELP}")
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown or not args.layouts:
        parser.error(f"--layouts {', '.join(unknown) or '(empty)'} unknown; valid: {', '.join(LAYOUTS)}")
    for field, low in (("rounds", 1), ("timed", 1), ("warm", 3)):
        if getattr(args, field) < low:
            parser.error(f"--{field} = {getattr(args, field)} is too small; valid: an integer >= {low}"
                         + (" (1-bit Adam compresses from step 2 on; only its compressed steps are timed)"
                            if field == "warm" else ""))
    if not 1024 <= args.port <= 65535 - len(args.rates):
        parser.error(f"--port = {args.port} is invalid; valid: 1024 .. {65535 - len(args.rates)}")
    return args


def node_command(node_rank: int, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    """One node's torchrun inside its namespace, and the environment it adds: (argv, env additions)."""
    argv = ["ip", "netns", "exec", PAIR.namespaces[node_rank], sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE), "--node-rank", str(node_rank),
            "--master-addr", PAIR.address(0), "--master-port", str(port), "--max-restarts", "0",
            "-m", "benchmarks.throttled_zero", "--worker", "--layouts", ",".join(args.layouts),
            "--rounds", str(args.rounds), "--warm", str(args.warm), "--timed", str(args.timed)]
    # gloo binds to the veth end's address: cross-node pairs go over the throttled veth, same-node pairs over
    # the namespace's local route. One thread per rank: 4 ranks share 2 cores.
    env = {"GLOO_SOCKET_IFNAME": PAIR.veths[node_rank], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return argv, env


def layout_recipe(name: str, steps: int, run_dir: str) -> dict:
    zero, optimizer = LAYOUTS[name]
    return {"model": {"preset": "gpt2-tiny", "n_layer": 4, "d_model": 256, "n_head": 4, "vocab_size": 8192,
                      "n_positions": 64, "dropout": 0.0, "attn_dropout": 0.0},
            "parallel": {"dp": NODES * PER_NODE, "node_size": PER_NODE, "timeout_s": 900}, "zero": zero,
            "train": {"steps": steps, "micro_batch": 1, "seq_len": 64, "precision": "fp32", "warmup_steps": 1},
            "optimizer": optimizer, "data": {"source": "synthetic", "synthetic_tokens": 20000},
            "logging": {"progress": False}, "checkpoint": {"at_end": False}, "sample": {"tokens": 0},
            "run": {"dir": run_dir}}


def _worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: a Trainer per layout, warm-up, then the interleaved timed rounds."""
    import torch
    import torch.distributed as dist

    from megazoo.parallel.topology import Topology, init_distributed
    from megazoo.recipes.config import Recipe, from_dict
    from megazoo.recipes.resolve import resolve
    from megazoo.recipes.training.trainer import Trainer
    from megazoo.workers.local import finish_worker

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_distributed(rank, world, init_method="env://", device="cpu", timeout_s=900)
    topo = Topology.build(world, 1, node_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    steps = args.warm + args.rounds * args.timed
    trainers, next_step, res = {}, {}, None
    for name in args.layouts:
        res = resolve(from_dict(Recipe, layout_recipe(name, steps, tempfile.mkdtemp(prefix="megazoo-thr-"))))
        torch.manual_seed(0)
        trainers[name] = Trainer(res, topo)
        for step in range(args.warm):
            trainers[name].train_step(step)
        next_step[name] = args.warm
    rows = []
    for round_index in range(args.rounds):
        for name in args.layouts:
            trainer, link = trainers[name], {"intra": 0.0, "inter": 0.0}
            dist.barrier()
            start = time.perf_counter()
            records = []
            for _ in range(args.timed):
                records.append(trainer.train_step(next_step[name]))
                for cls in link:  # the ledger holds the step just taken (train_step resets it first)
                    link[cls] += trainer.zero.comm.link_bytes.get(cls, 0.0)
                next_step[name] += 1
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step is as slow as the slowest rank
            rows.append({"layout": name, "round": round_index, "step_s": elapsed.item() / args.timed,
                         "tokens_per_s": args.timed * res.tokens_per_step / elapsed.item(),
                         "inter_bytes_per_step": link["inter"] / args.timed,
                         "intra_bytes_per_step": link["intra"] / args.timed,
                         "total_bytes_per_step": sum(r["comm_bytes"] for r in records) / args.timed,
                         "loss": records[-1]["loss"]})
    if rank == 0:
        unsharded = [t for name, t in trainers.items() if LAYOUTS[name][0]["stage"] < 3]  # ZeRO-3 holds 1/dp
        params = sum(p.numel() for p in unsharded[0].model.parameters()) if unsharded else None
        print(RESULT_TAG + json.dumps({"rows": rows, "params": params, "tokens_per_step": res.tokens_per_step}),
              flush=True)
    finish_worker(0)


def _run_rate(args: argparse.Namespace, port: int) -> dict:
    """Both nodes' torchruns for the rate now set on the link; node 0's rank 0 result line."""
    return run_nodes([node_command(node, args, port) for node in range(NODES)])


def run_nodes(commands: list[tuple[list[str], dict]], tag: str = RESULT_TAG) -> dict:
    """Each node's (argv, env) started at once; the JSON after `tag` on node 0's last result line. Every
    process still running on an error or Ctrl-C is stopped (torchrun forwards SIGTERM to its workers)."""
    procs = []
    try:
        for argv, env in commands:
            procs.append(subprocess.Popen(argv, cwd=REPO, env={**os.environ, **env}, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outs = [p.communicate(timeout=3600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    lines = [line for line in outs[0][0].splitlines() if line.startswith(tag)]
    if not lines:  # torch 2.13 + gloo may abort at exit after the result was printed: judge the result line
        codes = [p.returncode for p in procs]
        raise RuntimeError(f"no result from the run (exit codes {codes}):\n" + "\n".join(err[-3000:] for _, err in outs))
    return json.loads(lines[-1][len(tag):])


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (rate, layout): medians over the rounds, the ratio to flat ZeRO-3 at the same rate."""
    from statistics import median

    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        at_rate = [r for r in rows if r["rate"] == rate]
        for name in dict.fromkeys(r["layout"] for r in at_rate):
            mine = [r for r in at_rate if r["layout"] == name]
            out.append({"rate": rate, "layout": name, "tokens_per_s": median(r["tokens_per_s"] for r in mine),
                        "tokens_per_s_rounds": [round(r["tokens_per_s"], 1) for r in mine],
                        "step_s": median(r["step_s"] for r in mine),
                        **{k: mine[-1][k] for k in ("inter_bytes_per_step", "intra_bytes_per_step")}})
        base = next((r["tokens_per_s"] for r in out if r["rate"] == rate and r["layout"] == BASELINE), None)
        for r in out:
            if r["rate"] == rate:
                r["vs_flat_zero3"] = r["tokens_per_s"] / base if base else None
    return out


def markdown(result: dict) -> str:
    size = f"{result['params'] / 1e6:.1f} M-parameter" if result["params"] else "4 x 256"
    lines = [f"Throttled inter-node link (2 nodes x 2 ranks = dp 4, gloo, {size} "
             f"GPT fp32, {result['tokens_per_step']} tokens/step; {result['rounds']} interleaved rounds x "
             f"{result['timed']} timed steps per layout; load average {result['load_average'][0]:.1f} at the end):",
             "", "| inter-node link | layout | tokens/s (median) | per round | vs flat ZeRO-3 | inter-node MB/step/rank "
             "| intra-node MB/step/rank |", "|---|---|---:|---|---:|---:|---:|"]
    for r in result["summary"]:
        ratio = f"{r['vs_flat_zero3']:.2f}x" if r["vs_flat_zero3"] is not None else "-"
        lines.append(f"| {r['rate']} | {r['layout']} | {r['tokens_per_s']:.0f} | "
                     f"{' / '.join(f'{v:.0f}' for v in r['tokens_per_s_rounds'])} | {ratio} | "
                     f"{r['inter_bytes_per_step'] / 1e6:.2f} | {r['intra_bytes_per_step'] / 1e6:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    why_not = netns.missing_privileges()
    if why_not:
        print(f"throttled_zero: {why_not}", file=sys.stderr)
        return 2
    rows, info = [], {}
    try:
        with netns.namespaces(PAIR):
            for i, rate in enumerate(args.rates):
                netns.set_rate(PAIR, rate)
                info = _run_rate(args, args.port + i)
                for row in info["rows"]:
                    rows.append({"rate": rate, **row})
                    print(json.dumps(rows[-1]), flush=True)
    except KeyboardInterrupt:
        print("throttled_zero: interrupted; namespaces removed", file=sys.stderr)
        return 130
    except (RuntimeError, subprocess.CalledProcessError) as err:
        print(f"throttled_zero: {getattr(err, 'stderr', '') or err}", file=sys.stderr)
        return 1
    result = {"rows": rows, "summary": summarize(rows), "params": info["params"], "rounds": args.rounds,
              "timed": args.timed, "warm": args.warm, "tokens_per_step": info["tokens_per_step"],
              "load_average": os.getloadavg()}
    print(markdown(result), flush=True)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
