"""`megazoo reproduce claims`: the system claims of the ZeRO / DeepSpeed / Turing-NLG announcements, recomputed.

Every recomputed figure comes from the planner (recipes/planner/fit.py: model states as megazoo's ZeRO optimizers hold
them + activations + buffers per device against the GPU's memory, the ZeRO paper's model-state bytes shown beside
where they change a verdict; recipes/planner/shards.py: per-shard parameter counts) and the stated cost model
(recipes/planner/cost_model.py: model FLOPs at an MFU + un-overlapped communication over stated bandwidths), on the repo's
recipes where one exists (recipes/tnlg-17b.toml, gpt-100b.toml, gpt-1t.toml, read as `megazoo plan --recipe`
reads them). Published figures are quoted with their source; where our reading of a source is from memory it says
so. Nothing here runs a model: the numbers are exact for the planner's formulas. Where a dry run of the recipe
has been recorded (`python benchmarks/dry_run.py --json recipes/reproduce/dry_run_results.json`, shipped in the package:
the real training step at the full world size on fake tensors, recipes/dry_run/run.py), its measured peak, dp bytes
and FLOPs per role are shown beside the planner's, each column saying whether it is measured or computed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megazoo.models.presets import presets
from megazoo.models.layout import divisors
from megazoo.recipes.planner.zero import GB
from megazoo.recipes.planner.cost_model import CostModel, step_time
from megazoo.recipes.planner.fit import Layout, device_memory, max_micro_batch
from megazoo.recipes.gpus import GPUS
from megazoo.models.flops import model_flops_per_token
from megazoo.recipes.planner.fit_cli import planned_recipe
from megazoo.recipes.reproduce.common import Report, figure, table

DRY_RUN_JSON = Path(__file__).with_name("dry_run_results.json")  # benchmarks/dry_run.py --json (measured),
# package data: an installed megazoo shows it without a checkout
V100 = GPUS["v100-32gb"]  # 32 GB, 125 TFLOP/s fp16, DGX-2: 16 per node on NVSwitch
SRC_TNLG = ("Microsoft Research blog, \"Turing-NLG: A 17-billion-parameter language model by Microsoft\" (Rosset, "
            "Feb. 2020): with ZeRO, model parallelism 16 -> 4 and 4x the batch size per node")
SRC_ZERO = ("Rajbhandari et al. 2020, \"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models\": 100B+ "
            "models on 400 V100 GPUs at 15 PFLOPS (abstract), ~38 TFLOPS per GPU (sec. 10, from memory)")
SRC_3D = ("Microsoft Research blog, \"DeepSpeed: Extreme-scale model training for everyone\" (Sep. 2020): a "
          "trillion-parameter model with 3D parallelism on as few as 800 V100 GPUs")
SRC_LOWBW = ("DeepSpeed README (github.com/microsoft/DeepSpeed, 2020), communication efficiency / performance on a "
             "low-bandwidth cluster: GPT-2 1.5B with ZeRO-powered data parallelism 3.75x the throughput of "
             "Megatron-LM model parallelism across nodes, no NVLink or InfiniBand (cluster details: from memory)")


def _recipe(name: str, *sets: str):
    """(model, layout) of recipes/NAME.toml as `megazoo plan --recipe` reads it (user data files not needed)."""
    cfg, layout, _ = planned_recipe(name, sets)
    return cfg, layout


def tnlg(rep: Report) -> list[list]:
    cfg, recipe = _recipe("tnlg-17b")
    mem = {}
    for zero in (0, 1):
        for tp in divisors(cfg.n_head):
            lay = replace(recipe, dp=max(256 // tp, 1), tp=tp, zero=zero, micro_batch=1, grad_accum=1)
            mem[zero, tp] = (device_memory(cfg, lay, V100.memory_gb).total / GB,
                             max_micro_batch(cfg, lay, V100.memory_gb, limit=64))
    smallest = {z: min(tp for (zz, tp), (_, mb) in mem.items() if zz == z and mb) for z in (0, 1)}
    per_node = {z: (V100.per_node // smallest[z]) * mem[z, smallest[z]][1] for z in (0, 1)}
    rep.add("## T-NLG 17B on V100-32GB (recipes/tnlg-17b.toml: seq 1024, fp16, activation checkpointing)",
            f"Source: {SRC_TNLG}. Per-device GB at micro-batch 1, dp = 256 / tp, and the largest micro-batch "
            "that fits; tp must divide the 28 heads, so 16 is not a valid degree for this shape (14 is the closest).",
            table(["tp", "dp", "ZeRO-0 GB (mb 1)", "ZeRO-0 largest mb", "ZeRO-1 GB (mb 1)", "ZeRO-1 largest mb"],
                  [[tp, max(256 // tp, 1), f"{mem[0, tp][0]:.1f}", mem[0, tp][1] or "does not fit",
                    f"{mem[1, tp][0]:.1f}", mem[1, tp][1] or "does not fit"] for tp in divisors(cfg.n_head)]))
    rep.data["tnlg"] = {"memory": {f"zero{z}-tp{t}": v for (z, t), v in mem.items()}, "smallest_tp": smallest,
                        "batch_per_node": per_node}
    rep.data["_tnlg_plot"] = mem
    src = "Turing-NLG blog (Microsoft Research, Feb. 2020)"
    return [["T-NLG 17B: model parallelism without -> with ZeRO (256 V100-32GB)", "16 -> 4", src,
             f"{smallest[0]} -> {smallest[1]}", f"smallest tp that fits 32 GB: ZeRO-0 {smallest[0]} (16 does not "
             f"divide 28 heads), ZeRO-1 over dp = {256 // smallest[1]}: {smallest[1]}"],
            ["T-NLG 17B: batch per 16-GPU node with ZeRO", "4x", src,
             f"{per_node[1] / per_node[0]:.2f}x", f"{V100.per_node // smallest[0]} replica x mb "
             f"{mem[0, smallest[0]][1]} (tp {smallest[0]}) -> {V100.per_node // smallest[1]} replicas x mb "
             f"{mem[1, smallest[1]][1]} (tp {smallest[1]})"]]


def gpt100b(rep: Report) -> list[list]:
    cfg, lay = _recipe("gpt-100b")
    cm = CostModel.for_gpu(V100)
    mems = {z: device_memory(cfg, replace(lay, zero=z), V100.memory_gb) for z in (0, 1, 2, 3)}
    paper = {z: device_memory(cfg, replace(lay, zero=z), V100.memory_gb, paper=True) for z in mems}
    mem = mems[lay.zero]
    t = step_time(cfg, lay, mem.psi, cm)
    tflops = model_flops_per_token(cfg, lay.seq_len) * lay.global_batch * lay.seq_len / t.total / lay.gpus / 1e12
    rep.add("## 100B with ZeRO on 400 V100-32GB (recipes/gpt-100b.toml)", f"Source: {SRC_ZERO}. Layout: "
            f"{lay.describe()}. {' '.join(line.strip() for line in cm.describe())}",
            table(["ZeRO stage", "model states GB", "activations GB", "buffers GB", "total GB", "fits 32 GB",
                   "model states GB (ZeRO paper)", "total GB (ZeRO paper)"],
                  [[z, f"{m.model_states / GB:.1f}", f"{m.activations / GB:.1f}", f"{m.buffers / GB:.1f}",
                    f"{m.total / GB:.1f}", "yes" if m.fits else "no", f"{paper[z].model_states / GB:.1f}",
                    f"{paper[z].total / GB:.1f}"] for z, m in mems.items()]),
            "Model states are what megazoo's optimizers hold (recipes/planner/zero.py megazoo_state_memory, equal "
            "to their memory_bytes()): each rank keeps the gradient of the shard it owns in fp32, 4/N bytes per "
            "parameter, at ZeRO-1 beside the full fp16 gradient buffer (the paper: none) and at ZeRO-2 / 3 where the "
            "paper (2 + 2 + K = 12) counts an fp16 2/N; so +4/N, +2/N, +2/N bytes per parameter at stages 1, 2, 3.",
            f"Estimated step {t.total:.1f} s = compute {t.compute:.1f} + tp comm {t.tp_comm:.1f} + dp comm "
            f"{t.dp_comm:.1f}: {tflops:.1f} model TFLOPS per GPU, {tflops * lay.gpus / 1e3:.1f} PFLOPS in all (model "
            "FLOPs, recomputation not counted; the paper's count may include it).")
    rep.data["gpt100b"] = {z: m.total for z, m in mems.items()} | {"tflops_per_gpu": tflops, "step_s": t.total,
                                                                   "paper": {z: m.total for z, m in paper.items()}}
    rep.data["_100b_plot"] = mems
    paper = "ZeRO paper (Rajbhandari et al. 2020)"
    return [["100B with ZeRO on 400 V100s: fits", "trains (ZeRO-100B)", paper,
             f"fits: {mem.total / GB:.1f} GB at ZeRO-{lay.zero}",
             f"without ZeRO (stage 0) the same layout needs {mems[0].total / GB:.1f} GB"],
            ["100B with ZeRO on 400 V100s: throughput", "38 TFLOPS/GPU, 15 PFLOPS", paper,
             f"{tflops:.1f} TFLOPS/GPU, {tflops * lay.gpus / 1e3:.1f} PFLOPS", f"cost model at MFU {cm.mfu:g}, "
             "communication not overlapped"]]


def gpt1t(rep: Report) -> list[list]:
    cfg, lay = _recipe("gpt-1t")
    def fits(pp: int, offload: bool, paper: bool = False):
        return device_memory(cfg, replace(lay, pp=pp, stage_layers=None, offload=offload), V100.memory_gb,
                             paper=paper)
    # the smallest pipeline (fewest GPUs at tp 16 x dp 2) whose fullest stage fits 32 GB with the states on the GPU
    no_offload, paper_pp = (next(pp for pp in range(lay.pp, cfg.n_layer + 1) if fits(pp, False, p).fits)
                            for p in (False, True))
    paper_gb = fits(lay.pp, False, True).total / GB
    rows, by_pp = [], {}
    for pp in sorted({25, 26, 28, 30, 32, 40, 48, 64, no_offload}):
        on, off = fits(pp, False), fits(pp, True)
        by_pp[pp] = (on.total / GB, off.total / GB)
        rows.append([pp, on.layout.gpus, f"{on.total / GB:.1f}", "yes" if on.fits else "no", f"{off.total / GB:.1f}",
                     "yes" if off.fits else "no"])
    rep.add("## 1T with 3D parallelism on ~800 V100-32GB (recipes/gpt-1t.toml)", f"Source: {SRC_3D}. Layout: "
            f"tp {lay.tp} x pp x dp {lay.dp}, ZeRO-{lay.zero}, micro-batch {lay.micro_batch} x grad_accum "
            f"{lay.grad_accum}, seq {lay.seq_len}, activation checkpointing, 1F1B; GB on the fullest stage.",
            table(["pp", "GPUs", "GB, states on GPU", "fits", "GB, optimizer offloaded to CPU", "fits"], rows),
            f"The planner's verdict: at the published 800 GPUs (pp 25) the layout does not fit 32 GB with ZeRO-1 "
            f"alone ({by_pp[25][0]:.1f} GB); it fits with the optimizer states offloaded to CPU (ZeRO-Offload, "
            f"{by_pp[25][1]:.1f} GB; what recipes/gpt-1t.toml does), or without offload at pp {no_offload} "
            f"({no_offload * lay.tp * lay.dp} GPUs). By the ZeRO paper's bytes (2 + 2 + 12/N per parameter) pp 25 "
            f"would need {paper_gb:.1f} GB and pp {paper_pp} ({paper_pp * lay.tp * lay.dp} GPUs) would fit: "
            "megazoo's ZeRO-1 optimizer also holds the gradient of its owned shard in fp32 (4/N more bytes per "
            "parameter, 2 at N = 2). DeepSpeed likely partitioned activation checkpoints over tp (and kept them on "
            "CPU), which megazoo does not implement.")
    rep.data["gpt1t"] = {"by_pp": by_pp, "smallest_pp_without_offload": no_offload,
                         "paper": {"gb_at_800": paper_gb, "smallest_pp_without_offload": paper_pp}}
    return [["1T with 3D parallelism on ~800 V100s", "fits on 800", "DeepSpeed blog (Sep. 2020)",
             f"800 GPUs: {by_pp[25][0]:.1f} GB, does not fit; fits with CPU offload ({by_pp[25][1]:.1f} GB) or "
             f"on {no_offload * lay.tp * lay.dp} GPUs", "needs CPU offload (or activation partitioning) at 800; "
             f"by the ZeRO paper's bytes {paper_gb:.1f} GB, fits on {paper_pp * lay.tp * lay.dp} GPUs"]]


def low_bandwidth(rep: Report) -> list[list]:
    # Megatron-LM's GPT-2 1.5B shape (48 x 1600 with 16 heads, as its and DeepSpeed's example scripts configure it;
    # the parameter count equals GPT-2 1.5B's), on 4 nodes x 4 V100-16GB over PCIe, 40 Gb/s Ethernet between nodes.
    cfg = presets()["gpt2-1.5b"].replace(n_head=16)
    gpus, batch, per_node, capacity = 16, 512, 4, 16
    cm = CostModel(V100.peak_flops, 0.4, intra_node_bw=12e9, inter_node_bw=5e9 / per_node, per_node=per_node)
    results = {}
    for name, tp, zero in (("ZeRO-2 data parallel", 1, 2), ("ZeRO-1 data parallel", 1, 1),
                           ("data parallel, no ZeRO", 1, 0), ("Megatron tp 2 (in a node)", 2, 0),
                           ("Megatron tp 4 (one node)", 4, 0), ("Megatron tp 8 (across 2 nodes)", 8, 0),
                           ("Megatron tp 16 (across 4 nodes)", 16, 0)):
        dp = gpus // tp
        lay = Layout(dp, tp, 1, zero, 1, batch // dp, 1024, True, flash_attention=True)
        mb = max_micro_batch(cfg, lay, capacity, limit=batch // dp, divides=batch // dp)
        if not mb:
            results[name] = None
            continue
        lay = replace(lay, micro_batch=mb, grad_accum=batch // dp // mb)
        t = step_time(cfg, lay, device_memory(cfg, lay, capacity).psi, cm)
        results[name] = (lay, t, batch * 1024 / t.total)
    rows = [[n, "does not fit 16 GB", "", "", "", ""] if r is None else
            [n, r[0].micro_batch, f"{r[1].total:.2f}", f"{r[1].tp_comm:.2f}", f"{r[1].dp_comm:.2f}", f"{r[2]:,.0f}"]
            for n, r in results.items()]
    zero = max(results["ZeRO-2 data parallel"][2], results["ZeRO-1 data parallel"][2])
    across = max(r[2] for n, r in results.items() if r and "across" in n)
    best_mp = max(r[2] for n, r in results.items() if r and n.startswith("Megatron"))
    rep.add("## GPT-2 1.5B without NVLink / InfiniBand: ZeRO data parallel vs Megatron model parallel",
            f"Source: {SRC_LOWBW}. Assumed cluster (stated, not published): 16 V100-16GB in 4 nodes of 4 on PCIe "
            "(12 GB/s per GPU), nodes on 40 Gb/s Ethernet (5 GB/s per node, 1.25 GB/s per GPU); batch 512 x seq 1024, "
            "fp16, activation checkpointing; Megatron's GPT-2 1.5B shape (48 layers, hidden 1600, 16 heads). "
            f"Cost model: compute at MFU {cm.mfu:g} of 125 TFLOP/s, communication not overlapped.",
            table(["layout", "micro-batch", "step s", "tp comm s", "dp comm s", "tokens/s"], rows))
    rep.data["low_bandwidth"] = {n: (r[2] if r else None) for n, r in results.items()}
    rep.data["_lowbw_plot"] = results
    return [["GPT-2 1.5B, no NVLink/IB: ZeRO dp vs Megatron-only mp across nodes", "3.75x", "DeepSpeed README",
             f"{zero / across:.1f}x", f"vs tp across nodes; {zero / best_mp:.2f}x vs the best Megatron-only layout "
             "(tp 2 inside a node)"]]


def dry_run_section(rep: Report) -> None:
    """The recorded dry runs' measurements beside the planner's computed numbers (or how to record them)."""
    import json
    if not DRY_RUN_JSON.is_file():
        rep.add("## Measured by the dry run", f"Not recorded: every figure above is computed. Record with `python "
                f"benchmarks/dry_run.py --json recipes/reproduce/{DRY_RUN_JSON.name}`.")
        return
    rows = []
    for r in json.loads(DRY_RUN_JSON.read_text()):
        for role in r["roles"]:
            rows.append([r["recipe"], r["world_size"], f"{role['rank']} (stage {role['pp_stage']})",
                         f"{role['measured_peak_bytes'] / GB:.2f}", f"{role['planned_peak_bytes'] / GB:.2f}",
                         f"{role['dp_ring_bytes'] / GB:.2f}", f"{role['paper_dp_comm_bytes'] / GB:.2f}",
                         f"{role['flops'] / 1e15:.2f}", f"{role['formula_flops'] / 1e15:.2f}"])
    rep.add("## Measured by the dry run", f"From recipes/reproduce/{DRY_RUN_JSON.name} (benchmarks/dry_run.py): the "
            "real training step per pipeline role at the recipe's full world size on fake tensors. GB = 1e9 bytes.",
            table(["recipe", "ranks", "role", "peak GB (measured)", "peak GB (computed, planner)",
                   "dp GB/step (measured)", "dp GB/step (computed, ZeRO paper)", "PFLOP (measured)",
                   "PFLOP (computed, 6 N T + attention)"], rows))
    rep.data["dry_run"] = rows


def claims(args) -> Report:
    rep = Report("System claims of the ZeRO / DeepSpeed / Turing-NLG announcements, recomputed")
    rep.add("Recomputed by megazoo's planner (recipes/planner/fit.py: model states as megazoo's ZeRO optimizers hold them + "
            "Korthikanti activations + buckets per device; GB = 1e9 bytes, a V100-32GB holds 32 GB) and cost model "
            "(recipes/planner/cost_model.py). The summary first, then each claim's detail.")
    summary = tnlg(rep) + gpt100b(rep) + gpt1t(rep) + low_bandwidth(rep)
    dry_run_section(rep)
    rep.sections.insert(1, table(["claim", "published", "source", "recomputed", "how"], summary, "lllll"))
    rep.data["summary"] = summary
    fig, axes = figure(ncols=2, nrows=2, width=4.6, height=3.2)
    mem = rep.data.pop("_tnlg_plot")
    tps = sorted({tp for _, tp in mem})
    for z in (0, 1):
        axes[0].plot(tps, [mem[z, tp][0] for tp in tps], "o-", label=f"ZeRO-{z}")
    axes[0].axhline(32, color="gray", ls="--", lw=1, label="32 GB")
    axes[0].set(xscale="log", yscale="log", xlabel="tp (dp = 256 / tp)", ylabel="GB per device")
    axes[0].set_title("T-NLG 17B, micro-batch 1", fontsize=9)
    mems = rep.data.pop("_100b_plot")
    parts = [("model states", "model_states"), ("activations", "activations"), ("buffers", "buffers")]
    bottom = [0.0] * len(mems)
    for label, attr in parts:
        vals = [getattr(m, attr) / GB for m in mems.values()]
        axes[1].bar([f"ZeRO-{z}" for z in mems], vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[1].axhline(32, color="gray", ls="--", lw=1)
    axes[1].set_title("100B, tp 16 x dp 25 (400 V100): GB per device", fontsize=9)
    by_pp = rep.data["gpt1t"]["by_pp"]
    axes[2].plot(list(by_pp), [v[0] for v in by_pp.values()], "o-", label="states on GPU")
    axes[2].plot(list(by_pp), [v[1] for v in by_pp.values()], "s-", label="optimizer on CPU")
    axes[2].axhline(32, color="gray", ls="--", lw=1)
    axes[2].set(xlabel="pp (GPUs = 32 pp)", ylabel="GB per device")
    axes[2].set_title("1T, tp 16 x dp 2, ZeRO-1", fontsize=9)
    low = {n: r for n, r in rep.data.pop("_lowbw_plot").items() if r}
    axes[3].barh(list(low), [r[2] for r in low.values()], color="tab:green")
    axes[3].set(xscale="log", xlabel="tokens/s (cost model)")
    axes[3].set_title("GPT-2 1.5B, 16 V100-16GB, no NVLink/IB", fontsize=9)
    axes[3].tick_params(axis="y", labelsize=7)
    for ax in axes[:3]:
        ax.legend(fontsize=7)
    rep.figure = fig
    return rep
