"""The dry run with context parallelism (recipes/dry_run/run.py): the fake world is dp x tp x pp x cp ranks,
laid out by Topology.of as `megazoo train` lays them out, each role's ring or all-to-all attention runs under fake
tensors, its peak agrees with the planner and the cp bytes are counted; a role that fails says so.
"""

from __future__ import annotations

import pytest

from megazoo.parallel.topology import Topology
from megazoo.recipes.planner.cli import main as plan_main
from megazoo.recipes.dry_run.run import RoleFailed, load, roles, run_role
from megazoo.recipes.dry_run.report import report, to_text

TINY_CP = """
[model]
preset = "llama-tiny"
n_layer = 2
vocab_size = 300          # a small head: the blocks' activations (what cp splits) dominate the peak
dropout = 0.0
attn_dropout = 0.0
[parallel]
dp = 2
tp = 2
cp = 2
cp_attention = "{attention}"
sequence_parallel = true
[zero]
stage = 1
reduce_bucket_size = 20000
[train]
steps = 1
micro_batch = 2
grad_accum = 1
seq_len = 128
precision = "bf16"
[data]
source = "synthetic"
synthetic_tokens = 20000
[logging]
progress = false
[sample]
tokens = 0
[run]
dir = "{run_dir}"
"""


def _cp_recipe(tmp_path, attention="ring"):
    path = tmp_path / f"tiny-cp2-{attention}.toml"
    path.write_text(TINY_CP.format(attention=attention, run_dir=tmp_path / "run"))
    return path


def test_roles_follow_topology_of_the_cp_mesh(tmp_path):
    res = load(_cp_recipe(tmp_path))
    par = res.recipe.parallel
    assert res.world_size == 8
    (role,) = roles(res)
    assert sorted(role.ranks) == list(range(8))  # every (dp, cp, tp) of the one stage
    # the mapping is Topology.of's: cp between dp and tp, tp innermost
    assert Topology.rank_at(par, dp=1) == 4 and Topology.rank_at(par, cp=1) == 2 and Topology.rank_at(par, tp=1) == 1
    pp4 = load(_cp_recipe(tmp_path), ["parallel.dp=1", "parallel.pp=2", "model.n_layer=2"])
    first, last = roles(pp4)
    assert last.rank == Topology.rank_at(pp4.recipe.parallel, pp=1) == 4
    assert sorted(first.ranks + last.ranks) == list(range(8))


@pytest.mark.parametrize("attention", ["ring", "all_to_all"])
def test_cp2_dry_run_peak_matches_the_planner_and_counts_cp_bytes(tmp_path, attention):
    res = load(_cp_recipe(tmp_path, attention))
    par, t, cfg = res.recipe.parallel, res.recipe.train, res.model
    rep = report(res, [run_role(res, r) for r in roles(res)], 80, 0.0)
    (row,) = rep["roles"]
    assert rep["world_size"] == 8
    assert abs(row["relative_difference"]) < 0.10, row
    # attention across the cp split, per layer and micro-batch, in the tensors' bytes
    heads, head_dim, local = cfg.n_head // par.tp, cfg.d_model // cfg.n_head, t.seq_len // par.cp
    block = t.micro_batch * heads * local * head_dim  # one (b, h, s / cp, hd) tensor
    if attention == "ring":  # forward: K, V to the next rank cp - 1 times; backward: K, V again, dK, dV (fp32) cp times
        per_layer = (par.cp - 1) * 2 * block * 2 * 2 + par.cp * 2 * block * 4
        sent = sum(c["bytes"] for c in row["collectives"] if c["op"] == "send")
    else:  # Ulysses: q, k, v and the output there and back, their gradients in backward: 8 all-to-alls
        per_layer = 8 * block * 2
        sent = sum(c["bytes"] for c in row["collectives"] if c["op"] == "all_to_all" and c["group_size"] == par.cp)
    assert row["cp_attention_bytes"] == sent == cfg.n_layer * t.grad_accum * per_layer
    # gradients reduced over the dp x cp = 4 ranks: the ZeRO paper's volume for 4 ranks
    assert row["paper_dp_comm_bytes"] > 0
    assert abs(row["dp_ring_bytes"] - row["paper_dp_comm_bytes"]) <= 0.05 * row["paper_dp_comm_bytes"], row
    text = to_text(res, rep)
    assert "x cp=2" in text and f"cp attention bytes sent ({attention})" in text and "dp x cp ring bytes" in text


def test_a_failing_role_names_itself_and_the_error(tmp_path, monkeypatch, capsys):
    import megazoo.recipes.dry_run.run as dry_run

    def boom(*args, **kwargs):
        raise ValueError("a fake-tensor op failed")

    monkeypatch.setattr(dry_run, "measure_step", boom)
    path = _cp_recipe(tmp_path)
    res = load(path)
    with pytest.raises(RoleFailed, match=r"rank 0 \(pipeline stage 0.*ValueError: a fake-tensor op failed"):
        run_role(res, roles(res)[0])
    assert plan_main(["--recipe", str(path), "--dry-run", "--gpu-memory", "80"]) == 1
    err = capsys.readouterr().err
    assert "dry run of rank 0" in err and "ValueError: a fake-tensor op failed" in err


def test_flops_formula_counts_this_cp_ranks_tokens(tmp_path):
    res = load(_cp_recipe(tmp_path, "all_to_all"))
    rep = report(res, [run_role(res, r) for r in roles(res)], 80, 0.0)
    (row,) = rep["roles"]
    assert abs(row["flops"] - row["formula_flops"]) <= 0.10 * row["formula_flops"], row
