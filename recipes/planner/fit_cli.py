"""`megazoo plan` with a GPU: does it fit, the largest micro-batch, and the search over layouts.

    megazoo plan --recipe recipes/tnlg-17b.toml --gpu-memory 32         # fits: yes|no + breakdown; exit 0 | 3
    megazoo plan --recipe recipes/tnlg-17b.toml --gpu v100-32gb
    megazoo plan --model tnlg-17b --dp 64 --tp 4 --zero 1 --micro-batch 8 --activation-checkpointing --gpu-memory 32
    megazoo plan --search --model tnlg-17b --gpus 256 --gpu v100-32gb [--global-batch 512] [--mfu 0.4]

Memory: recipes/planner/fit.py (model states as megazoo's optimizers hold them, or with --paper by the ZeRO paper's
formulas; recipes/planner/activations.py; buffers). Ranking: recipes/planner/cost_model.py; the
assumptions it uses are printed with the list. recipes/planner/cli.py owns the flags and calls `run` here.
"""

from __future__ import annotations

import argparse

from megazoo.recipes.planner import hf_load
from megazoo.recipes.planner.zero import GB, PlanError
from megazoo.recipes.planner.cost_model import CostModel, search
from megazoo.recipes.planner.fit import Layout, device_memory, heal_bytes, max_micro_batch, parse_gpu, recipe_layout
from megazoo.recipes.gpus import GPUS
from megazoo.recipes.planner.reported import reported_lines

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 3


class FitUsageError(Exception):
    """Bad flags for the fit / search modes (exit 2)."""


def wanted(args: argparse.Namespace) -> bool:
    """True when the flags ask for a fit verdict or a search (otherwise plan_cli prints the ZeRO table)."""
    return bool(args.recipe or args.search or args.gpu_memory or args.gpu)


def _capacity(args) -> tuple[float, object]:
    if args.gpu_memory and args.gpu:
        raise FitUsageError("give one of --gpu-memory GB or --gpu NAME, not both")
    text = args.gpu_memory or args.gpu
    if not text and args.recipe and not args.search:  # the GPU the recipe's header names (recipes/catalog.py)
        from megazoo.recipes.catalog import stated_gpu
        text = stated_gpu(args.recipe)
    if not text:
        need = (f"--recipe {args.recipe} names no target GPU in its header (e.g. '# Target cluster: 16 V100-32GB')"
                if args.recipe and not args.search else "--recipe / --search need the GPU")
        raise FitUsageError(f"{need}: give --gpu-memory GB (e.g. 32) or --gpu NAME (valid: {', '.join(GPUS)})")
    try:
        return parse_gpu(text)
    except PlanError as err:
        raise FitUsageError(str(err).replace("--gpu-memory", "--gpu" if args.gpu else "--gpu-memory")) from None


def _int(flag: str, text, minimum: int = 1) -> int:
    try:
        value = int(str(text))
    except ValueError:
        raise FitUsageError(f"{flag} {text!r} is not an integer >= {minimum}") from None
    if value < minimum:
        raise FitUsageError(f"{flag} {value} is invalid; valid: an integer >= {minimum}")
    return value


def planned_recipe(recipe: str, sets=()):
    """(model, layout, resolved) of a recipe (a file, or a shipped recipe's name) as `plan --recipe` reads it:
    recipes/resolve.py's resolve_for_planning, so its corpus, tokenizer and checkpoint need not exist here."""
    from megazoo.recipes.catalog import find_recipe
    from megazoo.recipes.config import load_recipe
    from megazoo.recipes.resolve import resolve_for_planning
    resolved = resolve_for_planning(load_recipe(find_recipe(recipe), list(sets)))
    return resolved.model, recipe_layout(resolved), resolved


def _from_recipe(args):
    from megazoo.recipes.config import RecipeError
    try:
        return planned_recipe(args.recipe, args.set or [])
    except RecipeError as err:
        raise FitUsageError(f"--recipe {args.recipe}: {err}") from None


def _from_hf(args) -> str:
    """The recipe's model.from_hf as written (resolve_for_planning drops a folder not at hand)."""
    from megazoo.recipes.catalog import find_recipe
    from megazoo.recipes.config import load_recipe
    return load_recipe(find_recipe(args.recipe), list(args.set or [])).model.from_hf


def _from_flags(args):
    from megazoo.models.presets import presets
    registry = presets()
    if args.model not in registry:
        raise FitUsageError(f"--model {args.model!r} is not a known preset; valid: {', '.join(registry)}")
    cfg = registry[args.model]
    zero = _int("--zero", args.zero if args.zero is not None else 0, 0)
    seq = _int("--seq-len", args.seq_len or cfg.n_positions)
    layout = Layout(_int("--dp", args.dp), _int("--tp", args.tp), _int("--pp", args.pp), zero,
                    _int("--micro-batch", args.micro_batch), _int("--grad-accum", args.grad_accum), seq,
                    args.activation_checkpointing, args.offload, precision=args.train_precision,
                    flash_attention=not args.unfused_attention)
    return cfg, layout


def run(args: argparse.Namespace) -> int:
    capacity, gpu = _capacity(args)
    if args.search:
        return _run_search(args, capacity, gpu)
    if args.recipe:
        if args.model or args.params:
            raise FitUsageError("give --recipe or --model/--params, not both")
        cfg, layout, resolved = _from_recipe(args)
    elif args.model:
        cfg, layout = _from_flags(args)
    else:
        raise FitUsageError("--gpu-memory / --gpu need --recipe RECIPE.toml or --model PRESET")
    try:
        mem = device_memory(cfg, layout, capacity, paper=args.paper)
        best = max_micro_batch(cfg, layout, capacity, paper=args.paper)
    except PlanError as err:
        raise FitUsageError(str(err)) from None
    where = f"{cfg.name}" + (f" on {gpu.name}" if gpu else f" on a {capacity:g} GB GPU") + (
        " (the recipe's target GPU; --gpu NAME or --gpu-memory GB plans another)"
        if args.recipe and not (args.gpu or args.gpu_memory) else "")
    print(f"Memory plan: {where} (GB = 1e9 bytes, per device)")
    if cfg.n_experts:  # FLOPs (models/flops.py) count the active ones
        # multi-token prediction's modules apart: published totals (DeepSeek-V3's 671B) are the main model's
        main = cfg.replace(mtp_depth=0) if cfg.mtp_depth else None
        split = (f" ({main.num_parameters():,} main + {cfg.num_parameters() - main.num_parameters():,} in "
                 f"{cfg.mtp_depth} MTP module(s))" if main else "")
        print(f"  model: {cfg.num_parameters():,} parameters{split}, {cfg.num_active_parameters():,} active per token "
              f"({cfg.moe_top_k} of {cfg.n_experts} experts)")
    for line in mem.lines():
        print(line)
    print(f"  largest micro-batch that fits this layout: {best}" + (" (none: not even 1)" if not best else ""))
    if args.recipe and (loading := hf_load.describe(_from_recipe(args)[2], _from_hf(args))):  # model.from_hf
        print(loading)
    print("  activations: Korthikanti et al. 2022 per layer (recipes/planner/activations.py): s b h (10 + 24/t) bytes "
          "+ 5 a s^2 b / t for stored attention scores" + (" (none here: fused SDPA attention)"
                                                            if layout.flash_attention else "")
          + ("; checkpointing keeps r s b h per layer (r: the residual stream's bytes, 4 under ZeRO-0's autocast "
             "of fp32 parameters) + one layer recomputed" if layout.checkpointing else "")
          + "; in flight: walked on each rank's action list of the schedule (recipes/planner/schedule_memory.py; 1F1B: "
            "stage i holds pp - i), zero-bubble schedules holding each linear's input and output gradient from B to W")
    if args.recipe:  # a published layout: the report's own figures beside the plan (recipes/planner/reported.py)
        for line in reported_lines(args.recipe, resolved, cfg, gpu.peak_flops if gpu else None):
            print(line)
    heal_fits = _heal(args, layout, mem) if layout.replica_groups > 1 else True
    return EXIT_FITS if mem.fits and heal_fits else EXIT_DOES_NOT_FIT


def _heal(args, layout: Layout, mem) -> bool:
    """Print the heal's memory (a full copy of a group rank's state in flight, in host memory: fit.heal_bytes) and
    whether a node's host memory holds it (--host-memory GB per node; unchecked without it)."""
    per_rank = heal_bytes(mem)
    node = (_int("--gpus-per-node", args.gpus_per_node) if args.gpus_per_node else
            layout.node_size or min(layout.gpus, 8))
    need = node * (per_rank + mem.states.cpu_bytes) if mem.states is not None else node * per_rank
    print(f"  heal ({layout.replica_groups} fault-tolerant replica groups of dp {layout.dp // layout.replica_groups}): "
          f"a restarted group receives a full copy of each rank's state from a live group: {per_rank / GB:.2f} GB per "
          f"rank in flight (parameters + fp32 masters + Adam moments), in host memory on the sending and the "
          f"receiving node (torchft's HTTP transport), no device memory beyond the states above; {need / GB:.2f} GB "
          f"per node of {node} GPUs" + (" with the CPU-offloaded states" if layout.offload else ""))
    if not args.host_memory:
        print("  heal: host memory not checked (give --host-memory GB per node)")
        return True
    try:
        capacity = float(args.host_memory) * GB
    except ValueError:
        capacity = -1.0
    if not capacity > 0:
        raise FitUsageError(f"--host-memory {args.host_memory!r} is invalid; valid: GB of host memory per node > 0")
    if need <= capacity:
        print(f"  heal fits: {need / GB:.2f} GB of {capacity / GB:.2f} GB host memory per node")
        return True
    print(f"  heal does NOT fit: {need / GB:.2f} GB per node ({node} ranks x {need / node / GB:.2f} GB) exceeds "
          f"--host-memory {capacity / GB:g} GB; valid: more host memory per node, fewer GPUs per node "
          f"(--gpus-per-node), or smaller shards: more ranks per replica group (parallel.dp / "
          f"fault_tolerance.replica_groups) or a higher zero.stage")
    return False


def _run_search(args, capacity: float, gpu) -> int:
    if args.recipe:
        cfg, layout, resolved = _from_recipe(args)
        batch, seq, precision = resolved.global_batch, layout.seq_len, layout.precision
    elif args.model:
        cfg, layout = _from_flags(args)
        batch, seq, precision = 512, layout.seq_len, layout.precision
    else:
        raise FitUsageError("--search needs --model PRESET or --recipe RECIPE.toml")
    if args.global_batch:
        batch = _int("--global-batch", args.global_batch)
    if not args.gpus:
        raise FitUsageError("--search needs --gpus N (the GPUs to lay the model out on)")
    gpus = _int("--gpus", args.gpus)
    base = gpu or GPUS["v100-32gb" if capacity <= 32 else "a100-80gb"]
    cm = CostModel.for_gpu(base, mfu=args.mfu, intra_node_bw=args.intra_bw and args.intra_bw * 1e9,
                           inter_node_bw=args.inter_bw and args.inter_bw * 1e9,
                           per_node=args.gpus_per_node and _int("--gpus-per-node", args.gpus_per_node))
    if not 0 < cm.mfu <= 1:
        raise FitUsageError(f"--mfu {cm.mfu} is invalid; valid: 0 < MFU <= 1")
    found = search(cfg, gpus, capacity, cm, global_batch=batch, seq_len=seq, precision=precision,
                   flash_attention=layout.flash_attention, paper=args.paper)
    states = "the ZeRO paper's model-state formulas" if args.paper else "model states as megazoo's optimizers hold them"
    print(f"Layouts of {cfg.name} on {gpus} GPUs of {capacity:g} GB that fit (batch {batch} x seq {seq}, "
          f"{precision}; {states}), fastest first; {len(found)} found")
    for line in cm.describe():
        print(line)
    if gpu is None:
        print(f"  (compute and bandwidths of {base.name}: name a GPU with --gpu, or set --mfu/--intra-bw/--inter-bw)")
    print("")
    moe = any(c.layout.ep > 1 for c in found)  # expert parallelism: its degree and all-to-all time
    print("| rank | dp | tp | pp | " + ("ep | " if moe else "") + "zero | sharding | micro-batch | grad_accum | "
          "checkpointing | memory GB | step s | compute s | bubble s | tp comm s | pp comm s | dp comm s |"
          + (" ep comm s |" if moe else ""))
    print("|---:|---:|---:|---:|" + ("---:|" if moe else "") + "---:|:---|---:|---:|:---|---:|---:|---:|---:|---:|"
          "---:|---:|" + ("---:|" if moe else ""))
    for i, c in enumerate(found[:args.top], 1):
        lay, t = c.layout, c.time
        print(f"| {i} | {lay.dp} | {lay.tp} | {lay.pp} | " + (f"{lay.ep} | " if moe else "")
              + f"{lay.zero} | {lay.sharding} | {lay.micro_batch} | {lay.grad_accum} | "
              f"{'yes' if lay.checkpointing else 'no'} | {c.memory.total / GB:.1f} | {t.total:.2f} | "
              f"{t.compute:.2f} | {t.bubble:.2f} | {t.tp_comm:.2f} | {t.pp_comm:.2f} | {t.dp_comm:.2f} |"
              + (f" {t.ep_comm:.2f} |" if moe else ""))
    return EXIT_FITS if found else EXIT_DOES_NOT_FIT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default=None, help="plan this recipe's layout (on --gpu-memory / --gpu, default: "
                        "the GPU its header names)")
    parser.add_argument("--set", action="append", default=None, metavar="SECTION.KEY=VALUE",
                        help="override a recipe key (as megazoo train --set)")
    parser.add_argument("--gpu-memory", default=None, help="GPU memory in GB (1e9 bytes), e.g. 32; or a GPU name")
    parser.add_argument("--gpu", default=None, help=f"a named GPU: {', '.join(GPUS)}")
    parser.add_argument("--micro-batch", default="1", help="with --model: sequences per micro-batch (default 1)")
    parser.add_argument("--seq-len", default=None, help="with --model: tokens per sequence (default n_positions)")
    parser.add_argument("--activation-checkpointing", action="store_true", help="with --model: recompute blocks")
    parser.add_argument("--unfused-attention", action="store_true",
                        help="store the (b, a, s, s) attention scores (Megatron-style softmax; default: SDPA)")
    parser.add_argument("--train-precision", choices=("fp16", "bf16", "fp32"), default="fp16",
                        help="with --model in fit/search mode: activation and state precision (default fp16)")
    parser.add_argument("--host-memory", default=None, help="GB of host (CPU) memory per node: checks that a "
                        "fault-tolerant recipe's heal fits there")
    parser.add_argument("--search", action="store_true", help="list the layouts that fit, fastest first")
    parser.add_argument("--gpus", default=None, help="--search: GPUs in total")
    parser.add_argument("--gpus-per-node", default=None, help="--search: GPUs per node (tp stays within one)")
    parser.add_argument("--global-batch", default=None, help="--search: sequences per step (default: the "
                                                             "recipe's, or 512)")
    parser.add_argument("--mfu", type=float, default=None, help="--search: model FLOPs utilisation (default 0.4)")
    parser.add_argument("--intra-bw", type=float, default=None, help="--search: GB/s per GPU within a node")
    parser.add_argument("--inter-bw", type=float, default=None, help="--search: GB/s per GPU across nodes")
    parser.add_argument("--top", type=int, default=20, help="--search: rows printed (default 20)")
