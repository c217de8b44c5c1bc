"""`megazoo plan`: the ZeRO planner (recipes/planner/zero.py, recipes/planner/shards.py) on the command line.

    megazoo plan --model tnlg-17b --dp 64 --tp 4 --pp 1 --zero 3 [--offload] [--json]
    megazoo plan --params 7.5e9 --dp 64            # the ZeRO paper's Table 1 row: 120, 31.4, 16.6, 1.88 GB
    megazoo plan --recipe recipes/tnlg-17b.toml --gpu-memory 32      # fits: yes/no, exit 0/3 (plan_fit_cli.py)
    megazoo plan --search --model tnlg-17b --gpus 256 --gpu v100-32gb
    megazoo plan --model tnlg-17b --dp 256 --zero 3 --node-size 8 --inter-bw 3   # + bytes per link class and
                                                   # which of flat ZeRO / HSDP / hpZ wins (recipes/planner/links.py)

Without --zero every stage 0-3 is printed. Output: a markdown table per device (GB = 1e9 bytes), how Psi was
derived, and the buffer line (kept apart from the paper's model-state numbers); --json prints the same data.
recipes/cli.py wires `register(subparsers)` in; `main(argv)` runs it alone (tests, `python -m megazoo.recipes.planner.cli`).
"""

from __future__ import annotations

import argparse
import json
import sys
from decimal import Decimal, InvalidOperation

from megazoo.recipes.planner.zero import (FP32_ADAM, MIXED_ADAM, STAGE_NAMES, STAGES, BufferConfig, Plan, PlanError,
                                           StateBytes, format_gb, format_sig, plan)
from megazoo.recipes.planner import fit_cli as plan_fit_cli
from megazoo.recipes.planner.links import link_bytes, rank_shardings
from megazoo.recipes.planner.zero import GB
from megazoo.recipes.planner.shards import plan_model

# --paper: the ZeRO paper's bytes per parameter (bf16/fp16/mixed: 2 + 2 + K=12; fp32: 4 + 4 + 8). Without it,
# megazoo's own accounting in that precision (planner.megazoo_state_memory); "mixed" is bf16 there.
PRECISIONS = {"mixed": MIXED_ADAM, "bf16": MIXED_ADAM, "fp16": MIXED_ADAM, "fp32": FP32_ADAM}
MEGAZOO_BUCKET = 1 << 24  # recipes' zero.reduce_bucket_size default (recipes/config.py ZeroSection)


class UsageError(Exception):
    """Bad flags: printed as `megazoo plan: error: ...`, exit code 2."""


def _count(flag: str, text: str, minimum: int = 1) -> int:
    """An integer flag; scientific notation allowed when it is exact (7.5e9), never a silent truncation."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise UsageError(f"{flag} {text!r} is not a number; valid: an integer >= {minimum}") from None
    if not value.is_finite() or value != value.to_integral_value() or value < minimum:
        raise UsageError(f"{flag} {text} is invalid; valid: an integer >= {minimum}")
    return int(value)


def build_plan(args: argparse.Namespace) -> Plan:
    """Validate the flags (every message names the flag and what is valid) and compute the plan."""
    if (args.model is None) == (args.params is None):
        raise UsageError("give exactly one of --model PRESET (Psi from the preset, tp and pp) or --params COUNT "
                         "(Psi given directly)" + ("; both were given" if args.model else ""))
    dp = _count("--dp", args.dp)
    tp, pp = _count("--tp", args.tp), _count("--pp", args.pp)
    grad_accum = _count("--grad-accum", args.grad_accum)
    if args.zero is None:
        stages = STAGES
    else:
        try:
            stage = int(args.zero)
        except ValueError:
            stage = None
        if stage not in STAGES:
            raise UsageError(f"--zero {args.zero} is invalid; valid: 0, 1, 2, 3")
        stages = (stage,)
    state = PRECISIONS[args.precision]
    if args.k is not None:
        if not args.paper:
            raise UsageError("--k (optimizer bytes per parameter) is a parameter of the paper's formulas: add "
                             "--paper (megazoo's own plan counts the bytes its optimizers hold)")
        state = StateBytes(state.params, state.grads, _count("--k", args.k, minimum=0))
    if not args.paper:
        for flag in ("allgather_bucket", "prefetch", "persistence_threshold"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} is a DeepSpeed buffer megazoo does not have (its "
                                 "all-gathers write in place; stage 3 gathers whole units): add --paper")
    defaults = BufferConfig() if args.paper else BufferConfig(MEGAZOO_BUCKET, 0, 0, 0)
    def pick(flag: str, value: str | None, default: int, minimum: int = 1) -> int:
        return default if value is None else _count(flag, value, minimum)

    buffers = BufferConfig(pick("--reduce-bucket", args.reduce_bucket, defaults.reduce_bucket),
                           pick("--allgather-bucket", args.allgather_bucket, defaults.allgather_bucket),
                           pick("--prefetch", args.prefetch, defaults.prefetch),
                           pick("--persistence-threshold", args.persistence_threshold, defaults.persistence_threshold,
                                0))
    precision = None if args.paper else ("bf16" if args.precision == "mixed" else args.precision)
    common = dict(state=state, offload=args.offload, grad_accum=grad_accum, buffers=buffers, precision=precision)
    if args.params is not None:
        if tp != 1 or pp != 1:  # a raw count has no layers to split: it is already one device's count
            raise UsageError(f"--tp {tp} / --pp {pp} need --model; with --params give the per-device count "
                             "(valid: --tp 1 --pp 1)")
        return plan(_count("--params", args.params), dp, stages, **common)
    from megazoo.models.presets import presets
    registry = presets()
    if args.model not in registry:
        raise UsageError(f"--model {args.model!r} is not a known preset; valid: {', '.join(registry)}")
    try:
        return plan_model(registry[args.model], dp, tp, pp, stages, **common)
    except PlanError as err:  # the check names "parallel.tp"/"parallel.pp"; the user typed "--tp"/"--pp"
        message = str(err)
        for name in ("tp", "pp"):
            message = message.replace(f"parallel.{name} = ", f"--{name} ", 1).replace(f"valid {name}:",
                                                                                     f"valid --{name}:")
        raise UsageError(message) from None


def to_dict(p: Plan) -> dict:
    """The plan as plain JSON data: the inputs, Psi and its derivation, one object per stage (bytes, elements)."""
    rows = []
    for s in p.stages:
        m, c, b = s.memory, s.comm, s.buffers
        rows.append(dict(stage=s.stage, name=STAGE_NAMES[s.stage], params_bytes=m.params_bytes,
                         grads_bytes=m.grads_bytes, optimizer_bytes=m.optimizer_bytes, device_bytes=m.device_bytes,
                         cpu_bytes=m.cpu_bytes, total_bytes=m.total_bytes, comm_elements=c.elements,
                         comm_bytes=c.bytes, all_reduce_elements=c.all_reduce_elements,
                         reduce_scatter_elements=c.reduce_scatter_elements,
                         all_gather_elements=c.all_gather_elements, comm_factor=c.factor,
                         buffer_reduce_bucket_bytes=b.reduce_bucket_bytes,
                         buffer_allgather_bucket_bytes=b.allgather_bucket_bytes, buffer_prefetch_bytes=b.prefetch_bytes,
                         buffer_persistent_bytes=b.persistent_bytes, buffer_total_bytes=b.total_bytes))
    inputs = dict(psi=p.psi, dp=p.dp, params_bytes_per_param=p.state.params, grads_bytes_per_param=p.state.grads,
                  k=p.state.optimizer, offload=p.offload, grad_accum=p.grad_accum,
                  buffers=dict(vars(p.buffer_config)), planner="paper" if p.precision is None else "megazoo",
                  precision=p.precision)
    if p.precision is not None:  # megazoo's bytes per parameter differ by stage: no single (params, grads, K)
        for key in ("params_bytes_per_param", "grads_bytes_per_param", "k"):
            inputs.pop(key)
    out = dict(inputs=inputs, psi=p.psi, psi_derivation=p.derivation, stages=rows)
    if p.shard is not None:
        inputs.update(model=p.shard.model, tp=p.shard.tp, pp=p.shard.pp)
        out["shard"] = dict(padded_vocab=p.shard.padded_vocab, peak_stage=p.shard.peak.pp_rank,
                            stage_psi=[st.numel for st in p.shard.stages], sharded=p.shard.peak.sharded,
                            replicated=p.shard.peak.replicated)
    return out


def _elements(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return format_sig(x / scale) + unit
    return format_sig(x)


def to_markdown(p: Plan) -> str:
    """The readable report: title, Psi derivation, the per-device table, the buffer lines, the units."""
    st = p.state
    where = f"{p.shard.model}, tp={p.shard.tp} pp={p.shard.pp}, " if p.shard else ""
    extras = (", optimizer states offloaded to CPU" if p.offload else "") + (
        f", grad_accum = {p.grad_accum}" if p.grad_accum > 1 else "")
    if p.precision is None:
        lines = [f"ZeRO plan (the paper's formulas): {where}dp (N) = {p.dp}, {st.params} + {st.grads} + "
                 f"K={st.optimizer} bytes per parameter (params + grads + optimizer states){extras}", "",
                 p.derivation, ""]
    else:
        lines = [f"ZeRO plan (what megazoo's optimizers hold, {p.precision} training): {where}dp (N) = {p.dp}"
                 f"{extras}; bytes per parameter: stage 0 4 + 4 + 8 (fp32 storage, autocast); with ZeRO the "
                 f"params and grads in {p.precision}, an fp32 owned gradient, fp32 master (aliased to the owned "
                 "chunk in fp32) and Adam moments (recipes/planner/zero.py megazoo_state_memory; the ZeRO "
                 "paper's figures: --paper)", "", p.derivation, ""]
    head = ["stage", "params GB", "grads GB", "optimizer GB", "total GB"]
    if p.offload:
        head[-1] = "device GB"
        head.append("CPU GB")
    head += ["comm/step (elements sent)", "comm/step GB"]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join([":---"] + ["---:"] * (len(head) - 1)) + "|"]
    for s in p.stages:
        m, c = s.memory, s.comm
        cells = [f"{s.stage} ({STAGE_NAMES[s.stage]})", format_gb(m.params_bytes), format_gb(m.grads_bytes),
                 format_gb(m.optimizer_bytes), format_gb(m.device_bytes)]
        if p.offload:
            cells.append(format_gb(m.cpu_bytes))
        cells += [f"{_elements(c.elements)} = {c.factor}Psi(N-1)/N", format_gb(c.bytes)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    cfg = p.buffer_config
    if p.precision is not None:
        return "\n".join(lines + _megazoo_buffer_lines(p))
    for s in p.stages:
        b = s.buffers
        parts = [f"reduce bucket {format_gb(b.reduce_bucket_bytes)}"]
        if s.stage in (1, 2):
            parts.append(f"all-gather bucket {format_gb(b.allgather_bucket_bytes)}")
        if s.stage == 3:
            parts.append(f"prefetch {format_gb(b.prefetch_bytes)}")
            parts.append("persistent params " + (format_gb(b.persistent_bytes) if b.persistent_bytes is not None
                                                 else "n/a (needs --model)"))
        total = f" = {format_gb(b.total_bytes)}" if len(parts) > 1 else ""
        lines.append(f"Buffers GB, stage {s.stage} (not model states, not in the totals): {', '.join(parts)}{total}")
    source = "DeepSpeed's defaults" if cfg == BufferConfig() else "set by flags"
    lines += [f"  buffers = elements x {st.params} bytes, each capped at Psi: reduce_bucket {cfg.reduce_bucket:,}, "
              f"allgather_bucket {cfg.allgather_bucket:,}, stage-3 prefetch {cfg.prefetch:,}, "
              f"param_persistence_threshold {cfg.persistence_threshold:,} ({source})",
              "GB = 1e9 bytes, per device. comm/step = elements each rank sends over the dp group per optimizer "
              f"step (ring collectives), x {st.grads} bytes per gradient / {st.params} per parameter element."]
    return "\n".join(lines)


def _megazoo_buffer_lines(p: Plan) -> list[str]:
    lines = []
    for s in p.stages:
        b = s.buffers
        what = {0: "none (gradients are reduced as views of their buffer)",
                1: "none (the full gradient buffers are model states)",
                2: f"reduce buckets {format_gb(b.reduce_bucket_bytes)} (2 reducing + 1 filling)",
                3: "gathered units " + (f"{format_gb(b.prefetch_bytes)} (root + running and prefetched block, "
                                        "params and grads)" if b.persistent_bytes is not None
                                        else "n/a (needs --model)")}[s.stage]
        lines.append(f"Buffers GB, stage {s.stage} (estimate, not in the totals): {what}")
    return lines + [f"  reduce_bucket {p.buffer_config.reduce_bucket:,} elements (zero.reduce_bucket_size); "
                    "all-gathers write in place",
                    "GB = 1e9 bytes, per device. comm/step = elements each rank sends over the dp group per "
                    "optimizer step (ring collectives), in the stored element size (stage 0: fp32)."]


def run(args: argparse.Namespace) -> int:
    """The `plan` subcommand: print the plan (markdown or --json); 2 on bad flags. With a GPU (--gpu-memory,
    --gpu), a recipe or --search: the fit verdict / the layouts that fit (recipes/planner/fit_cli.py; 0 fits, 3 not)."""
    if args.dry_run:  # the real training step on a fake world of the recipe's size (recipes/dry_run/run.py)
        from megazoo.recipes.dry_run import cli as dry_run_cli
        return dry_run_cli.run(args)
    if plan_fit_cli.wanted(args):
        try:
            return plan_fit_cli.run(args)
        except (plan_fit_cli.FitUsageError, PlanError) as err:
            print(f"megazoo plan: error: {err}", file=sys.stderr)
            return 2
    try:
        p = build_plan(args)
    except (UsageError, PlanError) as err:
        print(f"megazoo plan: error: {err}", file=sys.stderr)
        return 2
    if args.node_size is None:
        print(json.dumps(to_dict(p), indent=2) if args.json else to_markdown(p))
        return 0
    try:
        lines = link_lines(p, _count("--node-size", args.node_size), args.intra_bw or 150.0, args.inter_bw or 12.5)
    except (UsageError, PlanError) as err:
        print(f"megazoo plan: error: {err}", file=sys.stderr)
        return 2
    print(to_markdown(p) + "\n\n" + "\n".join(lines))
    return 0


def link_lines(p: Plan, node_dp: int, intra_gbs: float, inter_gbs: float) -> list[str]:
    """Per stage: flat ZeRO, HSDP and hpZ's bytes per rank per step on each link class, fastest first; then the
    ZeRO++ quantized variants (qgZ; stage 3: hpZ + qwZ + qgZ), unranked."""
    element = p.state.params
    lines = [f"Per link class: {node_dp} dp ranks per node ({p.dp // min(node_dp, p.dp)} nodes), "
             f"{intra_gbs:g} GB/s intra-node, {inter_gbs:g} GB/s inter-node per GPU; GB per rank per step, "
             "nothing overlapped (recipes/planner/links.py)", "",
             "| stage | layout | intra-node GB | inter-node GB | comm s | model states GB (paper) |",
             "|---:|:---|---:|---:|---:|---:|"]
    for s in p.stages:
        ranked = rank_shardings(p.psi, p.dp, node_dp, s.stage, element_bytes=element, intra_bw=intra_gbs * 1e9,
                                inter_bw=inter_gbs * 1e9, state=p.state, grad_accum=p.grad_accum)
        for i, c in enumerate(ranked):
            v = c.volume
            lines.append(f"| {s.stage} | {v.sharding}{' (wins)' if i == 0 and len(ranked) > 1 else ''} | "
                         f"{v.intra * element / GB:.3g} | {v.inter * element / GB:.3g} | {c.seconds:.3g} | "
                         f"{c.state_bytes / GB:.3g} |")
        # ZeRO++'s quantized collectives, beside the exact layouts but not ranked with them: they change the
        # numerics (int8 weights, int4 gradients; loss bound in the README), so choosing them is the user's call
        by_sharding = {c.volume.sharding: c for c in ranked}
        for sharding, qwz, label in (("flat", False, "flat + qgZ int4"), ("hpz", True, "hpz + qwZ + qgZ int4")):
            if sharding in by_sharding and s.stage > 0:
                q = link_bytes(p.psi, p.dp, node_dp, s.stage, sharding, grad_accum=p.grad_accum,
                               element_bytes=element, quantized_weights=qwz, quantized_gradients="int4")
                seconds = q.intra / (intra_gbs * 1e9) + q.inter / (inter_gbs * 1e9)
                lines.append(f"| {s.stage} | {label} | {q.intra / GB:.3g} | {q.inter / GB:.3g} | {seconds:.3g} | "
                             f"{by_sharding[sharding].state_bytes / GB:.3g} |")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Numbers are read as text and checked by build_plan, so every error names its flag the same way.
    parser.add_argument("--model", default=None, help="preset name (see `megazoo presets`)")
    parser.add_argument("--params", default=None, help="Psi directly, e.g. 7.5e9 (instead of --model)")
    parser.add_argument("--dp", default="1", help="data-parallel degree N (default 1)")
    parser.add_argument("--tp", default="1", help="tensor-parallel degree, with --model (default 1)")
    parser.add_argument("--pp", default="1", help="pipeline stages, with --model (default 1)")
    parser.add_argument("--zero", default=None, help="ZeRO stage 0-3 (default: print every stage)")
    parser.add_argument("--offload", action="store_true", help="optimizer states in CPU memory (ZeRO-Offload)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16",
                        help="training precision (default bf16; mixed = bf16). megazoo's bytes per parameter: see "
                             "recipes/planner/zero.py megazoo_state_memory; with --paper: 2+2+12, fp32 4+4+8")
    parser.add_argument("--paper", action="store_true",
                        help="the ZeRO paper's formulas (2 + 2 + K bytes per parameter, Table 1) and DeepSpeed's "
                             "buffer defaults instead of the bytes megazoo's optimizers hold (bf16/fp16: stage 0 16, "
                             "1: 2 + 2 + 16/N, 2: 2 + 16/N, 3: 18/N B/param; the paper: 16, 4 + 12/N, 2 + 14/N, "
                             "16/N); with --recipe / --search / --gpu: the fit's model states by the paper's "
                             "formulas (activations and buffers are the same either way)")
    parser.add_argument("--k", default=None, help="with --paper: optimizer-state bytes per parameter")
    parser.add_argument("--grad-accum", default="1", help="micro-batches per step (stage 2/3 comm grows with it)")
    parser.add_argument("--reduce-bucket", default=None,
                        help="gradient bucket elements (default: zero.reduce_bucket_size's 2^24; --paper: 5e8)")
    parser.add_argument("--allgather-bucket", default=None, help="with --paper: elements (default 5e8)")
    parser.add_argument("--prefetch", default=None, help="with --paper: stage-3 prefetch elements (default 5e7)")
    parser.add_argument("--persistence-threshold", default=None,
                        help="with --paper: stage 3 keeps tensors below this many elements whole (default 1e5)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT",
                        help="print JSON instead of markdown; with --dry-run, --json OUT writes it to OUT")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --recipe: run one real training step per pipeline role at the recipe's full "
                             "world size on fake tensors, and report measured memory, communication and FLOPs")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="with --dry-run: the device of the fake tensors (cuda: a fake CUDA device in a fresh "
                             "interpreter, built on first use with g++; every CUDA call it stubs is listed as not "
                             "executed)")
    parser.add_argument("--node-size", default=None,
                        help="dp ranks per node: also print each stage's bytes per link class for flat ZeRO, HSDP "
                             "and hpZ and which is fastest at --intra-bw / --inter-bw (GB/s; default 150 / 12.5)")
    plan_fit_cli.add_arguments(parser)


def register(subparsers) -> argparse.ArgumentParser:
    """Add `plan` to the `megazoo` subcommands; its func returns the exit code."""
    parser = subparsers.add_parser("plan", help="ZeRO memory and communication plan per device",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megazoo plan", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
