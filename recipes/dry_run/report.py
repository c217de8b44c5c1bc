"""The dry run's report: each role's measurements beside the planner's numbers, the fit verdict, the JSON.

    megazoo plan --recipe recipes/tnlg-17b.toml --dry-run [--gpu-memory GB | --gpu NAME] [--json OUT]

Planner columns, per role's pipeline stage: model states as `megazoo plan` counts them, the bytes megazoo's ZeRO
optimizers hold (recipes/fit.state_memory: recipes/planner/zero.py's megazoo_state_memory, not the ZeRO paper's
Table 1) on the stage's exact parameter count (recipes/planner/shards.py), activations from recipes/planner/activations.py (with
fit.activation_spec: a fp32 residual stream under ZeRO-0's autocast), buffers from the planner's buffer_memory
(recipes/planner/fit.py's arithmetic, for this stage rather than the fullest). The activation
formula is taken for the attention kernel the dry run executes: no scores stored (the CPU's fused SDPA without
dropout; with dropout the recomputing kernel dry_run.gpu_kernels runs in SDPA's place). Communication: the
collectives on the dp group ("mesh_dp") in ring bytes sent per rank (all-reduce 2 (N-1)/N, reduce-scatter /
all-gather (N-1)/N of the tensor) beside the paper's per-step volume. FLOPs: FlopCounterMode's count beside
6 x matmul parameters x tokens + attention (models/flops.py's convention) for this stage's share, plus the
forward recomputed under activation checkpointing and the attention core's forward recomputed by
kernels.attention = "recompute".
Exit 0 when every role's measured peak fits the GPU, 3 when one does not (the planner's convention).
"""

from __future__ import annotations

from megazoo.models.layout import EXPERT_PARAMETERS, mtp_parameters, parameter_layout
from megazoo.recipes.planner.zero import GB, BufferConfig, buffer_memory, communication_volume
from megazoo.parallel.pipeline.partition import rank_chunks
from megazoo.parallel.pipeline.schedules import placement
from megazoo.recipes.dry_run.run import RoleResult, attention_recomputed, gpu_kernels
from megazoo.recipes.planner.fit import (PRECISION_BYTES, activation_spec, layout_activations, recipe_layout,
                                        stage_states, state_memory)
from megazoo.recipes.planner.links import fp8_gather_buffer, fp8_gather_change, fp8_gathered, link_bytes
from megazoo.recipes.planner.moe import all_to_all_link_bytes
from megazoo.recipes.planner.shards import shard_parameters
from megazoo.recipes.resolve import Resolved

RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_gather": lambda n: (n - 1) / n}


def planned(res: Resolved, pp_stage: int) -> dict[str, float]:
    """The planner's bytes for one pipeline stage's device: params, grads, optimizer (0 when offloaded),
    activations, buffers, total; and its dp communication per step (paper, ring bytes sent)."""
    cfg, layout = res.model, recipe_layout(res)
    # What the attention the dry run runs keeps: no scores with the CPU's fused SDPA (no dropout) or with the
    # recomputing kernel (under dropout it runs in SDPA's place: dry_run.gpu_kernels), as FlashAttention on a GPU.
    no_scores = layout.flash_attention and res.model.attn_dropout == 0.0 or attention_recomputed(res)
    state = PRECISION_BYTES[layout.precision][0]  # the paper's bytes: its buffers and communication volume
    shard = shard_parameters(cfg, layout.tp, layout.pp, layout.stage_layers, placement(layout.schedule))
    acts = layout_activations(cfg, layout, shard, activation_spec(cfg, layout, 1, no_scores))
    st = shard.stages[pp_stage]
    mem = state_memory(st.numel, layout)  # megazoo's optimizers' bytes, as `megazoo plan` counts them
    buffers = BufferConfig(layout.bucket, layout.bucket)
    buf = buffer_memory(st.numel, layout.zero, buffers, element_bytes=state.params,
                        persistent_elements=st.persistent_elements(buffers.persistence_threshold)).total_bytes
    if layout.fp8_all_gather:  # one block's FP8 weights gathered at 1 byte, before they are dequantized
        buf += fp8_gather_buffer(st.tensors)
    if layout.ep > 1:  # this rank's 1/ep of the experts, their states over the expert-data-parallel group
        _, mem, buf = stage_states(cfg, layout, st)
    grad_ranks = layout.dp * layout.cp  # gradients are reduced (and ZeRO partitions) over dp x cp
    # expert parallelism: the routed experts' 1/ep reduces (and ZeRO partitions) over the expert-data-parallel
    # group, (dp x cp) / ep ranks holding the same experts (parallel/expert/zero.py); the dense rest over dp x cp
    experts = sum(t.numel for t in st.tensors if t.name.endswith(EXPERT_PARAMETERS)) if layout.ep > 1 else 0
    edp, dense = grad_ranks // layout.ep, st.numel - experts
    comm = communication_volume(dense, grad_ranks, layout.zero, state, grad_accum=layout.grad_accum)
    if experts and edp > 1:
        comm = communication_volume(experts // layout.ep, edp, layout.zero, state,
                                    grad_accum=layout.grad_accum).bytes + comm.bytes
    else:
        comm = comm.bytes
    if layout.fp8_all_gather and grad_ranks > 1:  # the FP8 weights gathered at 1 byte (flat ZeRO-3 over dp x cp)
        comm += fp8_gather_change(**fp8_gathered(st.tensors), group=grad_ranks, element_bytes=state.params,
                                  grad_accum=layout.grad_accum)
    out = {"params": mem.params_bytes, "grads": mem.grads_bytes - mem.host_grads_bytes,
           "optimizer": 0.0 if layout.offload else mem.optimizer_bytes, "activations": acts[pp_stage].peak_bytes,
           "buffers": buf, "dp_comm_bytes": comm if grad_ranks > 1 else 0.0, "psi": st.numel,
           "expert_psi": experts // layout.ep, "edp": edp}
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["activations"] + buf
    if layout.ep > 1:  # the MoE layers' all-to-alls per link class (recipes/planner/moe.py), at dp = cp = tp rank 0
        held = rank_chunks(res.stage_layers, layout.pp, pp_stage, placement(layout.schedule))
        blocks = [i for v in held for i in res.stage_layers[v]]
        if len(res.stage_layers) - 1 in held:  # the head's stage: the MTP blocks, as layers n_layer + k - 1
            blocks += [cfg.n_layer + k for k in range(cfg.mtp_depth)]
        out["all_to_all_link_bytes"] = all_to_all_link_bytes(cfg, layout, blocks, pp_stage, state.params)
    if layout.node_size and layout.dp > 1:  # ZeRO's bytes per link class (recipes/planner/links.py)
        root = sum(t.numel for t in st.tensors if not t.name.startswith("h.")) if layout.zero == 3 else 0
        # ZeRO's groups are dp x cp: the whole group, and its part on one node
        per_node = layout.dp_per_node * layout.cp
        kw = dict(grad_accum=layout.grad_accum, element_bytes=state.params, quantized_weights=layout.quantized_weights,
                  quantized_gradients=layout.quantized_gradients)  # ZeRO++ qwZ / qgZ bytes
        links = link_bytes(dense, grad_ranks, per_node, layout.zero, layout.sharding, root=root, **kw,
                           **fp8_gathered(st.tensors) if layout.fp8_all_gather else {})
        out["link_bytes"] = {"intra": links.intra, "inter": links.inter}
        if experts and edp > 1:  # an ep group's ranks are consecutive: an edp group has per_node / ep on a node
            ex = link_bytes(experts // layout.ep, edp, max(1, per_node // layout.ep), layout.zero, layout.sharding,
                            **kw)
            out["link_bytes"] = {"intra": links.intra + ex.intra, "inter": links.inter + ex.inter}
    return out


def attention_width(cfg) -> float:
    """The attention core's width in models/flops.py's convention, 12 L s x width FLOPs per token: n_head x
    head_dim (not d_model: Qwen3's 32 heads of 128 are twice its d_model 2048; the formula used d_model and
    qwen3-30b-a3b's counted FLOPs were 11% over it), latent attention's n_head (qk + v) / 2."""
    if cfg.mla:
        return cfg.n_head * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2
    return cfg.n_head * cfg.head_dim


def formula_flops(res: Resolved, pp_stage: int) -> float:
    """6 x this tp rank's matmul parameters of the stage x its tokens (seq_len / cp of each sequence) + 12 L s w / tp
    attention per token (s: the whole sequence, which every query of a causal cp chunk sees on average; w:
    attention_width) (models/flops.py's convention), + one more forward (2 N + 4 L s w / tp)
    under activation checkpointing. MoE: the routed experts' parameters count top-k / n_experts (active; shared
    experts count whole), at any ep. torch's counter takes FlashAttention's backward as 2.5 forwards (it computes
    the scores again), the convention 2: the counted FLOPs are above this by 1/6 of the attention term.
    Multi-token prediction: its blocks, its projection and the head again on the head's rank."""
    cfg, t, par = res.model, res.recipe.train, res.recipe.parallel
    held = rank_chunks(res.stage_layers, par.pp, pp_stage, placement(par.schedule))  # its virtual stages
    layers = [i for v in held for i in res.stage_layers[v]]
    last = len(res.stage_layers) - 1 in held  # the head: the last rank, or the first under the V
    params = parameter_layout(cfg, par.tp, layers=layers, embedding=False, head=False)
    # multi-token prediction on the head's rank: per depth its projection and block (recomputed as a block is under
    # checkpointing, models/deepseek/mtp.py), the shared head once more and one more layer of attention
    depth = cfg.mtp_depth if last else 0
    params += mtp_parameters(cfg, par.tp) if depth else []
    # Routed experts (at expert-tp 1): a token runs top-k of the n_experts (the MFU convention's active
    # parameters), whatever ep; each tp rank routes all of its tokens, or its 1/tp of them under sequence parallelism
    active = cfg.moe_top_k / cfg.n_experts / (par.tp if par.sequence_parallel else 1) if cfg.is_moe else 1.0
    share = lambda p: active if p.name.endswith(EXPERT_PARAMETERS) else 1.0  # noqa: E731
    blocks = sum(p.local_numel(par.tp) * share(p) for p in params
                 if p.name.endswith(".weight") and ".ln_" not in p.name)
    head = (1 + depth) * res.padded_vocab * cfg.d_model // par.tp if last else 0  # the output projection
    tokens = t.micro_batch * t.grad_accum * t.seq_len // par.cp  # cp: this rank's chunks of every sequence
    attention = 12.0 * (len(layers) + depth) * t.seq_len * attention_width(cfg) / par.tp  # a window's mask: still s^2
    # torch's non-reentrant checkpoint stops recomputing once every saved tensor is back: without dropout after
    # it, the block's last matmul (mlp.c_proj, whose output nothing saves) is not run again.
    last_mm = sum(p.local_numel(par.tp) for p in params if p.name.endswith("mlp.c_proj.weight"))
    again = blocks - (last_mm if cfg.dropout == 0.0 else 0)
    recompute = (2.0 * again + attention / 3) if t.activation_checkpointing else 0.0
    if attention_recomputed(res):  # kernels.attention = "recompute": the attention core's forward in backward
        recompute += attention / 3
    return tokens * (6.0 * (blocks + head) + attention + recompute)


def dp_ring_bytes(result: RoleResult, dp: int, world: int, cp: int = 1) -> float:
    """Bytes this rank sends on its gradient group (dp x cp ranks) in the step, as ring collectives move them.
    DeviceMesh names the dp group "mesh_dp" (the cp group "mesh_cp" when dp = 1), Topology the dp x cp group
    "dp_cp"; when the group is the whole world DeviceMesh hands out the default group instead."""
    n = dp * cp
    names = ("mesh_dp",) if cp == 1 else ("mesh_cp",) if dp == 1 else ("dp_cp",)
    total = 0.0
    for (op, desc), (_, nbytes) in result.measured.by_group.items():
        if (desc.startswith(names) or desc == "default_pg" and n == world) and op in RING:
            total += nbytes * RING[op](n)
    return total


def cp_attention_bytes(result: RoleResult) -> float:
    """Bytes this rank sends for attention across the cp split in the step: ring attention's K / V and dK / dV
    blocks (send), or Ulysses' all-to-all of q, k, v and the output (and their gradients)."""
    return float(sum(nbytes for (op, desc), (_, nbytes) in result.measured.by_group.items()
                     if desc.startswith("mesh_cp") and op in ("send", "all_to_all", "all_to_all_single")))


def rel(measured: float, planned_value: float) -> float | None:
    return None if not planned_value else (measured - planned_value) / planned_value


def role_dict(res: Resolved, r: RoleResult) -> dict:
    plan = planned(res, r.role.pp_stage)
    m, par = r.measured, res.recipe.parallel
    world = res.world_size
    return {"rank": r.role.rank, "pp_stage": r.role.pp_stage, "ranks": list(r.role.ranks), "why": r.role.why,
            "measured_peak_bytes": m.peak["total"], "planned_peak_bytes": plan["total"],
            "relative_difference": rel(m.peak["total"], plan["total"]),
            "by_category": {k: v for k, v in m.peak.items() if k != "total"}, "host_bytes": m.host_bytes,
            "planned_by_category": {k: plan[k] for k in ("params", "grads", "optimizer", "activations", "buffers")},
            "collectives": m.collectives, "by_group": [[op, desc, count, nbytes] for (op, desc), (count, nbytes)
                                                       in sorted(m.by_group.items())],
            "dp_ring_bytes": dp_ring_bytes(r, par.dp, world, par.cp), "cp_attention_bytes": cp_attention_bytes(r),
            "paper_dp_comm_bytes": plan["dp_comm_bytes"],
            "link_bytes": {k: v for k, v in m.link_bytes.items() if not k.startswith("all_to_all_")},
            "all_to_all_link_bytes": {k.removeprefix("all_to_all_"): v for k, v in m.link_bytes.items()
                                      if k.startswith("all_to_all_")},
            "planned_all_to_all_link_bytes": plan.get("all_to_all_link_bytes", {}),
            "planned_link_bytes": plan.get("link_bytes", {}), "copies": m.copies, "flops": m.flops, "formula_flops": formula_flops(
                res, r.role.pp_stage), "placeholders": m.host_reads, "seconds": r.seconds}


def report(res: Resolved, results: list[RoleResult], capacity_gb: float, seconds: float) -> dict:
    rows = [role_dict(res, r) for r in results]
    fits = all(row["measured_peak_bytes"] <= capacity_gb * GB for row in rows)
    return {"world_size": res.world_size, "fits": fits, "gpu_memory_gb": capacity_gb, "roles": rows,
            "seconds": seconds, "notes": gpu_kernels(res)[1]}


def _gb(x: float) -> str:
    return f"{x / GB:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def to_text(res: Resolved, rep: dict) -> str:
    par, t = res.recipe.parallel, res.recipe.train
    lines = [f"Dry run: {res.model.name}, dp={par.dp} x tp={par.tp} x pp={par.pp}"
             f"{f' x cp={par.cp} ({par.cp_attention})' if par.cp > 1 else ''} = {rep['world_size']} ranks, "
             f"ZeRO-{res.recipe.zero.stage}{' + CPU offload' if res.recipe.zero.offload == 'cpu' else ''}, "
             f"{t.precision}, micro-batch {t.micro_batch} x grad_accum {t.grad_accum}, seq {t.seq_len}: one "
             f"training step per role on fake tensors and a fake process group ({rep['seconds']:.1f} s)",
             f"  data: zero token batches of the recipe's shape (no corpus read); device: "
             f"{rep.get('device', 'CPU kernels')} (GB = 1e9 bytes)"] + [f"  note: {note}" for note in rep.get("notes", [])]
    if "not_executed" in rep:
        lines.append("  not executed: CUDA runtime calls the fake device answered instead (call x count: answer):")
        lines += [f"    {row['kind']}: {row['call']} x {row['count']}: {row['answer']}" for row in rep["not_executed"]]
    for row in rep["roles"]:
        c, p = row["by_category"], row["planned_by_category"]
        n = len(row["ranks"])
        lines += ["", f"role: rank {row['rank']} (pipeline stage {row['pp_stage']}), stands for {n} rank"
                      f"{'s' if n != 1 else ''}: {row['why']} ({row['seconds']:.1f} s)",
                  f"  peak GB measured {_gb(row['measured_peak_bytes'])} vs planner {_gb(row['planned_peak_bytes'])}"
                  f" ({_pct(row['relative_difference'])})",
                  f"    measured: params {_gb(c['params'])}, grads {_gb(c['grads'])}, optimizer "
                  f"{_gb(c['optimizer'])}, activations {_gb(c['activations'])}, backward temporaries "
                  f"{_gb(c['temporaries'])}, other {_gb(c['other'])}"
                  + (f"; CPU (offloaded optimizer) {_gb(row['host_bytes'])}" if row["host_bytes"] else ""),
                  f"    planner:  params {_gb(p['params'])}, grads {_gb(p['grads'])}, optimizer {_gb(p['optimizer'])}"
                  f", activations {_gb(p['activations'])}, buffers {_gb(p['buffers'])}",
                  "  collectives in the step (op, group size: count, bytes of the tensors):"]
        for col in row["collectives"]:
            lines.append(f"    {col['op']:>14} over {col['group_size']:>3}: {col['count']:>6} x, "
                         f"{col['bytes'] / GB:.4f} GB")
        if par.cp > 1:
            lines.append(f"  cp attention bytes sent ({par.cp_attention}): {_gb(row['cp_attention_bytes'])} GB")
        grads = "dp" if par.cp == 1 else "dp x cp"
        lines.append(f"  {grads} ring bytes sent: {_gb(row['dp_ring_bytes'])} GB vs the ZeRO paper's "
                     f"{_gb(row['paper_dp_comm_bytes'])} GB ({_pct(rel(row['dp_ring_bytes'], row['paper_dp_comm_bytes']))})")
        if par.ep > 1:
            lines.append(f"  ZeRO groups: the dense weights over {grads} ({par.dp * par.cp} ranks), the routed experts' "
                         f"1/{par.ep} over their expert-data-parallel group ({par.dp * par.cp // par.ep} rank"
                         f"{'s' if par.dp * par.cp // par.ep != 1 else ''}, the ranks holding the same experts)")
        for link, nbytes in sorted(row.get("link_bytes", {}).items()):  # with parallel.node_size
            want = row["planned_link_bytes"].get(link, 0.0)
            lines.append(f"  ZeRO {link}-node bytes sent: {_gb(nbytes)} GB vs the planner's {_gb(want)} GB "
                         f"({_pct(rel(nbytes, want))})")
        for link, want in sorted(row.get("planned_all_to_all_link_bytes", {}).items()):  # expert parallelism
            got = row["all_to_all_link_bytes"].get(link, 0.0)
            lines.append(f"  MoE all-to-all {link}-node bytes sent: {_gb(got)} GB vs the planner's {_gb(want)} GB "
                         f"({_pct(rel(got, want))})")
        for way, (count, nbytes, blocking) in sorted(row.get("copies", {}).items()):
            lines.append(f"  {way.replace('_', '-')} copies: {count} x, {nbytes / GB:.4f} GB, {blocking} blocking")
        lines.append(f"  FLOPs: {row['flops']:.4g} counted vs {row['formula_flops']:.4g} by formula "
                     f"({_pct(rel(row['flops'], row['formula_flops']))})")
        for site, count in row["placeholders"].items():
            lines.append(f"  placeholder: {count} host read(s) at {site} returned 0 (fake tensors hold no value)")
    verdict = "yes" if rep["fits"] else "no"
    worst = max(r["measured_peak_bytes"] for r in rep["roles"])
    lines += ["", f"fits: {verdict} (largest measured peak {_gb(worst)} GB of {rep['gpu_memory_gb']:g} GB)"]
    return "\n".join(lines)
