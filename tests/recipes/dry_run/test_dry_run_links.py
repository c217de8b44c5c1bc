"""The dry run counts ZeRO's bytes per link class (intra- vs inter-node) at the recipe's full world size, and
they are what recipes/planner/links.py's formulas say; the planner ranks HSDP / hpZ beside flat ZeRO."""

from __future__ import annotations

import pytest
from recipe_helpers import tiny_resolved

from megazoo.models.layout import parameter_layout
from megazoo.recipes.planner.cli import main as plan_main
from megazoo.recipes.planner.cost_model import CostModel, search
from megazoo.recipes.dry_run.run import roles, run_role
from megazoo.recipes.dry_run.report import report, to_text
from megazoo.recipes.planner.links import fp8_gathered, link_bytes, link_volume, rank_shardings
from megazoo.recipes.planner.shards import shard_parameters
from megazoo.recipes.planner.zero import MIXED_ADAM, PlanError

DP, NODE = 8, 2  # 4 "nodes" of 2 dp ranks


QWZ, QGZ8, QGZ4 = {"quantized_weights": True}, {"quantized_gradients": "int8"}, {"quantized_gradients": "int4"}
FP8 = {"fp8_all_gather": True}  # with train.fp8 = "tensorwise": the FP8 linears' weights gathered as float8


def _stage_tensors(res):
    return shard_parameters(res.model, 1, 1, res.stage_layers).stages[0].tensors


@pytest.mark.parametrize("stage, sharding, quantized", [
    (2, "flat", {}), (3, "flat", {}), (1, "hsdp", {}), (2, "hsdp", {}), (3, "hsdp", {}), (3, "hpz", {}),
    (3, "flat", QWZ), (1, "flat", QGZ4), (2, "flat", QGZ8), (3, "hpz", {**QWZ, **QGZ4}), (3, "flat", FP8)])
def test_dry_run_counts_the_planned_bytes_per_link(stage, sharding, quantized):
    zero = {"stage": stage, "reduce_bucket_size": 20_000, "shard_group": "node" if sharding == "hsdp" else "dp",
            "hpz": sharding == "hpz", **quantized}
    res = tiny_resolved(parallel={"dp": DP, "node_size": NODE}, zero=zero,
                        train={"micro_batch": 1, "grad_accum": 2, "precision": "fp32", "steps": 1,
                               "fp8": "tensorwise" if quantized == FP8 else "none"},
                        kernels={"adamw": ""})  # the reference loop reads the step count on the host
    result = run_role(res, roles(res)[0])
    measured = result.measured.link_bytes
    psi = sum(p.numel for p in parameter_layout(res.model))  # what the model allocates (padded vocabulary)
    # stage 3's root unit (every parameter outside the blocks) is gathered in forward only
    root = sum(p.numel for p in parameter_layout(res.model) if not p.name.startswith("h.")) if stage == 3 else 0
    planned = link_bytes(psi, DP, NODE, stage, sharding, grad_accum=2, root=root, element_bytes=4,
                         quantized_weights=bool(quantized.get("quantized_weights")),
                         quantized_gradients=quantized.get("quantized_gradients", "none"),
                         **(fp8_gathered(_stage_tensors(res)) if quantized == FP8 else {}))
    # Buckets are padded to a multiple of dp (< dp elements each) and the gradient norm adds 2 numbers: 0.1%;
    # quantized chunks are padded to whole blocks of 256 (the tiny model's chunks are a few thousand elements)
    rel = 1e-2 if quantized else 1e-3  # measured: at most 0.54% (hpZ + qwZ + qgZ, inter)
    assert measured.get("inter", 0.0) == pytest.approx(planned.inter, rel=rel)
    assert measured.get("intra", 0.0) == pytest.approx(planned.intra, rel=rel)
    if quantized:  # the quantized collectives did run, and cut the cross-node bytes (HSDP's gathers: in the node)
        exact = link_volume(psi, DP, NODE, stage, sharding, grad_accum=2, root=root)
        link = "intra" if sharding == "hsdp" else "inter"
        assert measured[link] < 0.8 * getattr(exact, link) * 4
    # the dry run's report puts the same plan beside the measurement (megazoo plan --recipe R --dry-run)
    rep = report(res, [result], 80.0, 0.0)
    row = rep["roles"][0]
    for link in ("intra", "inter"):
        assert row["planned_link_bytes"][link] == pytest.approx(measured.get(link, 0.0), rel=rel)
    assert "ZeRO inter-node bytes sent" in to_text(res, rep)


@pytest.mark.parametrize("stage, sharding", [(2, "hsdp"), (3, "hpz")])
def test_dry_run_bytes_per_link_with_context_parallelism(stage, sharding):
    """cp 2: ZeRO's groups are dp x cp (HSDP: the node's dp x cp ranks), and the plan counts them so."""
    zero = {"stage": stage, "reduce_bucket_size": 20_000, "shard_group": "node" if sharding == "hsdp" else "dp",
            "hpz": sharding == "hpz"}
    res = tiny_resolved(parallel={"dp": 4, "cp": 2, "node_size": 4}, zero=zero,
                        train={"micro_batch": 1, "grad_accum": 2, "precision": "fp32", "steps": 1},
                        kernels={"adamw": ""})
    result = run_role(res, roles(res)[0])
    row = report(res, [result], 80.0, 0.0)["roles"][0]
    assert result.measured.link_bytes["inter"] > 0 and result.measured.link_bytes["intra"] > 0
    for link in ("intra", "inter"):
        assert row["planned_link_bytes"][link] == pytest.approx(result.measured.link_bytes[link], rel=1e-3)


def test_which_layout_wins_depends_on_the_inter_node_bandwidth():
    psi, dp, node = 7_500_000_000, 64, 8  # the ZeRO paper's 7.5B model on 8 nodes of 8
    def ranked(inter_gbs, stage=3):
        return [c.volume.sharding for c in rank_shardings(psi, dp, node, stage, element_bytes=2, intra_bw=150e9,
                                                          inter_bw=inter_gbs * 1e9, state=MIXED_ADAM)]
    assert ranked(3) == ["hsdp", "hpz", "flat"]  # slow network: the fewest cross-node bytes win
    # inter-node as fast as intra-node: every byte costs alike. flat sends 3 (N-1)/N Psi = 2.95 Psi; HSDP
    # 3 (n-1)/n + 2 (n-1)/n^2 = 2.84 Psi and hpZ 2 (N-1)/N + (n-1)/n = 2.84 Psi: a tie, broken by memory (hpZ's
    # states are partitioned over all 64 ranks, HSDP's over 8). Flat ZeRO wins on memory only.
    assert ranked(150) == ["hpz", "hsdp", "flat"]
    flat, hsdp, hpz = (link_volume(psi, dp, node, 3, s) for s in ("flat", "hsdp", "hpz"))
    assert flat.inter == pytest.approx(3 * psi * 63 / 64) and flat.intra == 0
    assert hpz.inter == pytest.approx(2 / 3 * flat.inter)  # ZeRO++: hpZ removes the backward gather's third
    assert hsdp.inter == pytest.approx(2 * psi / 8 * 7 / 8)  # one all-reduce of the node's chunk
    for stage in (1, 2, 3):  # once per step, whatever the accumulation (the micro-batches' sums add up first)
        assert link_volume(psi, dp, node, stage, "hsdp", grad_accum=4).inter == pytest.approx(hsdp.inter)
    # bf16: one micro-batch crosses the reduce-scatter output (2 bytes), several the owned fp32 chunk (4 bytes)
    assert link_bytes(psi, dp, node, 2, "hsdp", element_bytes=2).inter == pytest.approx(hsdp.inter * 2)
    assert link_bytes(psi, dp, node, 2, "hsdp", element_bytes=2, grad_accum=4).inter == pytest.approx(hsdp.inter * 4)
    assert [c.volume.sharding for c in rank_shardings(psi, dp, node, 0, element_bytes=2, intra_bw=1,
                                                      inter_bw=1, state=MIXED_ADAM)] == ["flat"]
    with pytest.raises(PlanError, match=r"dp ranks per node = 3 must divide dp = 64"):
        link_volume(psi, dp, 3, 3, "hsdp")
    with pytest.raises(PlanError, match=r"sharding 'hpz' needs ZeRO stage 3 \(got 2\)"):
        link_volume(psi, dp, 8, 2, "hpz")


def test_search_ranks_hsdp_and_hpz_layouts():
    from megazoo.models.presets import get_preset
    cm = CostModel(peak_flops=312e12, intra_node_bw=300e9, inter_node_bw=3e9, per_node=8)
    found = search(get_preset("gpt2-1.5b"), 64, 80.0, cm, global_batch=64, seq_len=1024, zero_stages=(3,))
    kinds = {c.layout.sharding for c in found}
    assert kinds == {"flat", "hsdp", "hpz"}
    best = {}
    for c in found:  # the fastest of each sharding at the same (dp, tp, pp)
        key = (c.layout.dp, c.layout.tp, c.layout.pp, c.layout.sharding)
        best.setdefault(key, c)
    for (dp, tp, pp, kind), c in best.items():
        if kind == "flat" and (dp, tp, pp, "hsdp") in best:
            assert best[(dp, tp, pp, "hsdp")].time.dp_comm < c.time.dp_comm  # 3 GB/s across nodes: HSDP wins
    assert found[0].layout.sharding != "flat"


def test_plan_cli_prints_bytes_per_link_and_the_winner(capsys):
    assert plan_main(["--params", "7.5e9", "--dp", "64", "--zero", "3", "--node-size", "8", "--inter-bw", "3"]) == 0
    out = capsys.readouterr().out
    assert "8 dp ranks per node (8 nodes)" in out and "| 3 | hsdp (wins) |" in out and "| 3 | hpz |" in out
    assert "| 3 | hpz + qwZ + qgZ int4 | 16.5 | 7.92 |" in out  # ZeRO++ quantized, listed unranked
    assert plan_main(["--params", "7.5e9", "--dp", "64", "--zero", "3", "--node-size", "3"]) == 2
    assert "dp ranks per node = 3 must divide dp = 64" in capsys.readouterr().err


def test_quantized_collectives_bytes_per_link():
    psi, dp, node = 7_500_000_000, 64, 8  # 8 nodes of 8, fp16
    flat = link_bytes(psi, dp, node, 3, element_bytes=2)
    assert flat.inter == pytest.approx(3 * psi * 63 / 64 * 2) and flat.intra == 0
    int8, int4 = 1 + 4 / 256, 0.5 + 4 / 256  # bytes per element with one fp32 scale per 256
    qwz = link_bytes(psi, dp, node, 3, element_bytes=2, quantized_weights=True)
    assert qwz.inter == pytest.approx(psi * 63 / 64 * (2 * int8 + 2))  # both gathers int8, reduce-scatter fp16
    qgz = link_bytes(psi, dp, node, 3, element_bytes=2, quantized_gradients="int4")
    assert qgz.intra == pytest.approx(psi * 7 / 8 * int4)  # the all-to-all inside the node
    assert qgz.inter == pytest.approx(psi * 63 / 64 * 4 + psi / 8 * 7 / 8 * int4)  # gathers + node partials
    both = link_bytes(psi, dp, node, 3, "hpz", element_bytes=2, quantized_weights=True, quantized_gradients="int4")
    assert both.inter == pytest.approx(psi * 63 / 64 * int8 + psi / 8 * 7 / 8 * int4)
    assert both.intra == pytest.approx(psi * 7 / 8 * 2 + psi * 7 / 8 * int4)  # hpZ's exact backward gather + qgZ
    assert flat.inter / both.inter > 5  # ZeRO++'s cross-node cut (the paper: 3 M -> 0.75 M counting qgZ as 1/4)
    stage1 = link_bytes(psi, dp, node, 1, element_bytes=2, quantized_gradients="int8", grad_accum=4)
    assert stage1.inter == pytest.approx(psi * 63 / 64 * 2 + psi / 8 * 7 / 8 * int8)  # stage 1 reduces once
    with pytest.raises(PlanError, match=r"qwZ \(quantized weights\) needs ZeRO stage 3 \(got 2\)"):
        link_bytes(psi, dp, node, 2, quantized_weights=True)
    with pytest.raises(PlanError, match=r"qgZ \(quantized gradients\) needs ZeRO stage 1-3, flat or hpz"):
        link_bytes(psi, dp, node, 3, "hsdp", quantized_gradients="int8")
    with pytest.raises(PlanError, match=r"quantization 'int2' is invalid; valid: none, int8, int4"):
        link_bytes(psi, dp, node, 3, quantized_gradients="int2")


def test_fp8_all_gather_halves_the_gathered_bytes_of_bf16():
    """zero.fp8_all_gather: the FP8 weights' two gathers per micro-batch at 1 byte instead of 2 (bf16); the
    reduce-scatter and the other parameters' gathers unchanged; + one fp32 amax per FP8 weight per step."""
    psi, root, fp8, weights, dp, node = 10_000_000, 2_000_000, 6_000_000, 40, 8, 8  # one node: all intra
    plain = link_bytes(psi, dp, node, 3, root=root, element_bytes=2, grad_accum=2)
    ours = link_bytes(psi, dp, node, 3, root=root, element_bytes=2, grad_accum=2, fp8=fp8, fp8_weights=weights)
    gathers = 2 * 2 * fp8 * (dp - 1) / dp  # 2 micro-batches x (forward + backward)
    assert plain.intra - ours.intra == pytest.approx(gathers * 2 / 2 - 2 * weights * (dp - 1) / dp * 4)
    assert ours.inter == plain.inter == 0.0
