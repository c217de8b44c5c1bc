"""DiLoCo against the other answers to a slow inter-node link, at equal tokens: flat ZeRO-1, HSDP ZeRO-1, 1-bit
Adam and 0/1 Adam (ZeRO-0), DiLoCo over HSDP's nodes (plain, 1-bit and int8 outer gradients). Tokens/s and
the loss after the same tokens, in one run. Never a timed test.

    python -m benchmarks.diloco                               (root: network namespaces)
    python -m benchmarks.diloco --rate 1gbit --steps 96 --inner-steps 8 --json out.json

The setting is benchmarks/throttled_zero.py's: two network namespaces (benchmarks/netns.py) are two nodes joined
by a veth pair limited to --rate with `tc tbf`, one torchrun of 2 gloo ranks per namespace (dp 4, node_size 2),
the same 5.3 M-parameter GPT 4 x 256 in fp32 on synthetic tokens, 256 tokens per step. Every layout starts from
the same weights and reads the same batches. To spread the load of other users of the machine over all layouts
alike, the layouts take turns: --inner-steps steps of each in turn (a whole DiLoCo period, outer step included),
until each has trained --steps. Reported per layout: tokens/s (all its steps, the slowest rank's time), the mean
training loss of its last --inner-steps steps, the validation loss after the last step (same 2 global batches for
all: for DiLoCo after an outer step, so every group holds the same weights) and cross-node MB per step per rank
(CommLedger). The namespaces are removed at the end, also on error or Ctrl-C; without root it says so, exit 2.
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
from benchmarks.throttled_zero import ZERO_ONE, layout_recipe, run_nodes

REPO = Path(__file__).resolve().parents[1]
PAIR = netns.VethPair(("mzd0", "mzd1"), ("mzd-veth0", "mzd-veth1"), "10.231.79")
NODES, PER_NODE = 2, 2
RESULT_TAG = "DILOCO_RESULT "
HSDP = {"stage": 1, "shard_group": "node"}
# name -> (zero, optimizer, diloco sections); the first is the baseline of the ratios
LAYOUTS: dict[str, tuple[dict, dict, dict]] = {
    "flat-zero1": ({"stage": 1}, {}, {}),
    "hsdp-zero1": (HSDP, {}, {}),
    "onebit-zero0": ({"stage": 0}, {"name": "onebit_adam", "freeze_step": 2}, {}),
    "zeroone-zero0": ({"stage": 0}, ZERO_ONE, {}),
    "diloco": (HSDP, {}, {"enabled": True}),
    "diloco-onebit": (HSDP, {}, {"enabled": True, "compression": "onebit"}),
    "diloco-int8": (HSDP, {}, {"enabled": True, "compression": "int8"}),
}
BASELINE = "flat-zero1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit", help=f"the inter-node rate: {netns.RATE_HELP}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=48, help="optimizer steps per layout (equal tokens)")
    parser.add_argument("--inner-steps", type=int, default=8, help="DiLoCo's H; also the steps per turn")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate")
    parser.add_argument("--lr", type=float, default=6e-4, help="the (inner) AdamW learning rate of every layout")
    parser.add_argument("--port", type=int, default=29831, help="rendezvous port")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the launch, under torchrun
    args = parser.parse_args(argv)
    try:
        args.rate = netns.check_rate(args.rate.strip())
    except ValueError as err:
        parser.error(f"--rate: {err}")
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown or not args.layouts:
        parser.error(f"--layouts {', '.join(unknown) or '(empty)'} unknown; valid: {', '.join(LAYOUTS)}")
    if args.inner_steps < 1 or args.steps < args.inner_steps or args.steps % args.inner_steps:
        parser.error(f"--steps = {args.steps} / --inner-steps = {args.inner_steps}: valid: inner steps >= 1 and "
                     "steps a positive multiple of them (the run ends on an outer step)")
    for field in ("outer_lr", "lr"):
        if not getattr(args, field) > 0:
            parser.error(f"--{field.replace('_', '-')} = {getattr(args, field)} is invalid; valid: a number > 0")
    return args


def recipe(name: str, args: argparse.Namespace, run_dir: str) -> dict:
    zero, optimizer, diloco = LAYOUTS[name]
    table = layout_recipe("flat-zero3", args.steps, run_dir)  # throttled_zero's model, data and train sections
    table["zero"], table["optimizer"] = dict(zero), dict(optimizer)
    table["train"].update(eval_batches=2, lr=args.lr, min_lr=args.lr / 10)
    if diloco:
        table["diloco"] = {**diloco, "inner_steps": args.inner_steps, "outer_lr": args.outer_lr}
    return table


def node_command(node_rank: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    argv = ["ip", "netns", "exec", PAIR.namespaces[node_rank], sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE), "--node-rank", str(node_rank),
            "--master-addr", PAIR.address(0), "--master-port", str(args.port), "--max-restarts", "0",
            "-m", "benchmarks.diloco", "--worker", "--layouts", ",".join(args.layouts), "--steps", str(args.steps),
            "--inner-steps", str(args.inner_steps), "--outer-lr", str(args.outer_lr), "--lr", str(args.lr)]
    return argv, {"GLOO_SOCKET_IFNAME": PAIR.veths[node_rank], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: a Trainer per layout, the layouts in turns of --inner-steps steps."""
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
    trainers, res = {}, None
    for name in args.layouts:
        res = resolve(from_dict(Recipe, recipe(name, args, tempfile.mkdtemp(prefix="megazoo-diloco-"))))
        torch.manual_seed(0)
        trainers[name] = Trainer(res, topo)
    seconds = {name: 0.0 for name in args.layouts}
    losses = {name: [] for name in args.layouts}
    inter = {name: 0.0 for name in args.layouts}
    for turn in range(args.steps // args.inner_steps):
        for name in args.layouts:
            trainer = trainers[name]
            dist.barrier()
            start = time.perf_counter()
            for step in range(turn * args.inner_steps, (turn + 1) * args.inner_steps):
                losses[name].append(trainer.train_step(step)["loss"])
                inter[name] += trainer.zero.comm.link_bytes.get("inter", 0.0)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a turn is as slow as its slowest rank
            seconds[name] += elapsed.item()
    rows = []
    for name, trainer in trainers.items():
        rows.append({"layout": name, "tokens_per_s": args.steps * res.tokens_per_step / seconds[name],
                     "seconds": seconds[name], "final_train_loss": sum(losses[name][-args.inner_steps:])
                     / args.inner_steps, "val_loss": trainer.evaluate(), "losses": losses[name],
                     "inter_bytes_per_step": inter[name] / args.steps})
    if rank == 0:
        print(RESULT_TAG + json.dumps({"rows": rows, "tokens_per_step": res.tokens_per_step}), flush=True)
    finish_worker(0)


def _run(args: argparse.Namespace) -> dict:
    return run_nodes([node_command(node, args) for node in range(NODES)], RESULT_TAG)


def markdown(result: dict) -> str:
    base = next((r for r in result["rows"] if r["layout"] == BASELINE), None)
    lines = [f"{result['rate']} inter-node link, 2 nodes x 2 ranks (dp 4, gloo), {result['steps']} steps x "
             f"{result['tokens_per_step']} tokens per layout, AdamW lr {result['lr']}, DiLoCo H = "
             f"{result['inner_steps']}, outer lr {result['outer_lr']}, Nesterov 0.9; load average "
             f"{result['load_average'][0]:.1f} at the end:", "",
             "| layout | tokens/s | vs flat ZeRO-1 | train loss, last H steps | validation loss | "
             "inter-node MB/step/rank |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"
        lines.append(f"| {r['layout']} | {r['tokens_per_s']:.0f} | {ratio} | {r['final_train_loss']:.4f} | {val} | "
                     f"{r['inter_bytes_per_step'] / 1e6:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    why_not = netns.missing_privileges()
    if why_not:
        print(f"diloco: {why_not}", file=sys.stderr)
        return 2
    try:
        with netns.namespaces(PAIR):
            netns.set_rate(PAIR, args.rate)
            info = _run(args)
    except KeyboardInterrupt:
        print("diloco: interrupted; namespaces removed", file=sys.stderr)
        return 130
    except (RuntimeError, subprocess.CalledProcessError) as err:
        print(f"diloco: {getattr(err, 'stderr', '') or err}", file=sys.stderr)
        return 1
    result = {**info, "rate": args.rate, "steps": args.steps, "inner_steps": args.inner_steps,
              "outer_lr": args.outer_lr, "lr": args.lr, "load_average": os.getloadavg()}
    print(markdown(result), flush=True)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
