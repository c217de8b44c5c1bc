"""Node-aware ZeRO: the node mesh, HSDP (zero.shard_group = "node") and ZeRO++ hpZ (zero.hpz), at dp 4 as
2 "nodes" x 2 ranks on this machine. Each layout trains the same function as one process (fp64, 1e-10), and the
bytes each rank sends per link class (intra-node / inter-node) are exactly what the volumes in
parallel/zero/groups.py say, counted from the buckets the run laid out."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved
from parity_helpers import assert_same_training, train_run

from megazoo.parallel.topology import Topology, check_node_size
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

STEPS = 2
LAYOUTS = {  # name -> (zero section, train section) at dp 4 on 2 nodes of 2
    "flat3": ({"stage": 3}, {"micro_batch": 2}),
    "hsdp1": ({"stage": 1, "shard_group": "node"}, {"micro_batch": 1, "grad_accum": 2}),
    # stages 2-3 with gradient accumulation: the owned chunk crosses nodes once per step, not per micro-batch
    "hsdp2": ({"stage": 2, "shard_group": "node"}, {"micro_batch": 1, "grad_accum": 2}),
    "hsdp3a": ({"stage": 3, "shard_group": "node"}, {"micro_batch": 1, "grad_accum": 2}),
    "hsdp2-offload": ({"stage": 2, "shard_group": "node", "offload": "cpu"}, {"micro_batch": 1, "grad_accum": 2}),
    "hsdp3": ({"stage": 3, "shard_group": "node"}, {"micro_batch": 2}),
    # hpZ with activation checkpointing: the recomputed forward in backward gathers from the secondaries
    "hpz3": ({"stage": 3, "hpz": True}, {"micro_batch": 1, "grad_accum": 2, "activation_checkpointing": True}),
}


def _members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group)) if group is not None else []


def _mesh(dp, tp, pp, node_size):
    topo = Topology.build(dp, tp, pp, node_size=node_size)
    return (topo.dp_per_node, topo.dp_intra_rank, topo.dp_inter_rank, _members(topo.dp_intra_group),
            _members(topo.dp_inter_group), _members(topo.dp_group))


def test_node_groups_split_dp_inside_and_across_nodes():
    got = run_distributed(_mesh, 4, 4, 1, 1, 2)
    assert [g[:3] for g in got] == [(2, 0, 0), (2, 1, 0), (2, 0, 1), (2, 1, 1)]
    assert [g[3] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # each node's dp ranks
    assert [g[4] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # the same node-local position across nodes
    # tp 2 on nodes of 2: each node holds one tp group, so dp crosses nodes only (intra: a group of one = None)
    got = run_distributed(_mesh, 4, 2, 2, 1, 2)
    assert [(g[0], g[3], g[4] == g[5]) for g in got] == [(1, [], True)] * 4
    # no node size: one node, the dp group is the intra group
    got = run_distributed(_mesh, 2, 2, 1, 1, 0)
    assert [(g[0], g[3], g[4]) for g in got] == [(2, [0, 1], []), (2, [0, 1], [])]


def test_node_size_must_fit_the_layout():
    assert check_node_size(2, 4, 1, 1, 4) == 2 and check_node_size(8, 2, 2, 2, 8) == 2
    with pytest.raises(ValueError, match=r"parallel.node_size = 3 does not divide the world size 4"):
        check_node_size(3, 4, 1, 1, 4)
    with pytest.raises(ValueError, match=r"parallel.node_size = 2 would split a tensor-parallel group of tp x cp"):
        check_node_size(2, 2, 4, 1, 8)
    with pytest.raises(ValueError, match=r"parallel.node_size = 4 puts 4 dp ranks .* parallel.dp = 6"):
        check_node_size(4, 6, 1, 2, 12)
    with pytest.raises(ValueError, match=r"parallel.node_size = -1 is invalid"):
        check_node_size(-1, 2, 1, 1, 2)
    with pytest.raises(RecipeError, match=r"parallel.node_size = 3 does not divide the world size 4"):
        resolve(tiny_recipe(parallel={"dp": 4, "node_size": 3}))


@pytest.mark.parametrize("zero, message", [
    ({"stage": 0, "shard_group": "node"}, r"zero.shard_group = 'node' needs zero.stage 1, 2 or 3"),
    ({"stage": 2, "hpz": True}, r"zero.hpz = true needs zero.stage = 3 \(got 2\)"),
    ({"stage": 3, "hpz": True, "shard_group": "node"}, r"redundant"),
    ({"stage": 1, "shard_group": "rack"}, r"zero.shard_group = 'rack' is invalid; valid: 'dp', 'node'"),
])
def test_shard_choices_are_checked_before_any_process_starts(zero, message):
    with pytest.raises(RecipeError, match=message):
        resolve(tiny_recipe(parallel={"dp": 2}, zero=zero))


@pytest.fixture(scope="module")
def reference():
    return train_run(tiny_resolved(train={"micro_batch": 8, "steps": STEPS}), Topology.solo())


@pytest.fixture(scope="module")
def runs():
    """Every layout of LAYOUTS in one 4-rank job (one fork for all): its training, then one more step whose
    bytes per link class and bucket sizes are returned."""
    resolved = {name: tiny_resolved(parallel={"dp": 4, "node_size": 2}, zero=zero, train={**train, "steps": STEPS})
                for name, (zero, train) in LAYOUTS.items()}

    def work():
        topo = Topology.build(4, node_size=2)
        out = {}
        for name, res in resolved.items():
            trainer = Trainer(res, topo)
            result = trainer.fit()
            got = {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                   "params": trainer.full_state_dict()}
            trainer.train_step(STEPS)  # the ledger then holds exactly this step's traffic
            zero = trainer.zero
            got["links"] = dict(zero.comm.link_bytes)
            got["calls"] = dict(zero.comm.calls)
            units = getattr(zero, "units", None)
            got["numel"] = {"all": sum(b.numel for b in zero.buckets), "buckets": len(zero.buckets),
                            "root": sum(b.numel for b in units[-1].buckets) if units else 0}
            out[name] = got
        return out

    return run_distributed(work, 4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_node_aware_zero_equals_one_process(runs, reference, name):
    for rank in runs:
        assert_same_training(rank[name], reference)


def _expected_links(name: str, numel: dict[str, int]) -> dict[str, float]:
    """Bytes per rank per step (fp64) from the volumes in parallel/zero/groups.py; dp 4 = 2 nodes x 2.
    A group spanning nodes counts as inter-node; the gradient norm's all-reduce of 2 numbers is included."""
    p, root, b = numel["all"], numel["root"], 8
    blocks = p - root
    flat, node, across = 3 / 4, 1 / 2, 1 / 2  # (N-1)/N of the dp group, of a node, of the 2 nodes
    norm = lambda size: 2 * 2 * size * b  # noqa: E731 - all_reduce of [sharded, replicated] squares
    if name == "flat3":  # per micro-batch: forward gather (blocks + root), backward gather (blocks), reduce-scatter
        return {"inter": ((2 * blocks + root) + p) * flat * b + norm(flat)}
    if name == "hpz3":  # per micro-batch (2): forward gather + reduce-scatter over dp; backward gather in the node
        return {"inter": 2 * ((blocks + root) + p) * flat * b + norm(flat), "intra": 2 * blocks * node * b}
    # the owned chunk (p / 2) all-reduced over the 2 nodes: once per step, whatever the accumulation
    chunk_allreduce = 2 * (p / 2) * across * b
    if name == "hsdp1":  # one reduce-scatter (last micro-batch), one all-gather, inside the node
        return {"intra": 2 * p * node * b + norm(node), "inter": chunk_allreduce}
    if name.startswith("hsdp2"):  # a reduce-scatter per micro-batch (2), one all-gather, inside the node
        return {"intra": 3 * p * node * b + norm(node), "inter": chunk_allreduce}
    a = 2 if name == "hsdp3a" else 1
    return {"intra": a * ((2 * blocks + root) + p) * node * b + norm(node), "inter": chunk_allreduce}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bytes_per_link_class_follow_the_formula(runs, name):
    for rank in runs:
        got, want = rank[name]["links"], _expected_links(name, rank[name]["numel"])
        assert got.keys() == want.keys()
        for link in want:
            assert got[link] == pytest.approx(want[link], rel=1e-12), link
    flat, hpz, hsdp = (runs[0][n]["links"] for n in ("flat3", "hpz3", "hsdp3"))
    assert hpz["inter"] / 2 < flat["inter"] and 3 * hsdp["inter"] <= flat["inter"]  # per micro-batch, both save


@pytest.mark.parametrize("name", ["hsdp2", "hsdp3a", "hsdp2-offload"])
def test_hsdp_crosses_nodes_once_per_step_under_gradient_accumulation(runs, name):
    """2 micro-batches per step: the inter-node bytes are one all-reduce of the owned chunks, as with one
    micro-batch (hsdp3), and there is one inter-node all-reduce per bucket, not one per bucket and micro-batch."""
    for rank in runs:
        got = rank[name]
        buckets = got["numel"]["buckets"]
        assert got["links"]["inter"] == pytest.approx(2 * (got["numel"]["all"] / 2) / 2 * 8, rel=1e-12)
        # all-reduces: one per bucket across nodes + the norm's two (dp inside the node, tp: a group of one)
        assert got["calls"]["all_reduce"] == buckets + 1
    assert runs[0]["hsdp3a"]["links"]["inter"] == runs[0]["hsdp3"]["links"]["inter"]


def test_hsdp_and_hpz_with_tp_and_pp_equal_one_process(reference):
    """8 ranks, two meshes in one job: dp 4 x tp 2 on 2 nodes of 4 (HSDP stage 3, hpZ), dp 4 x pp 2 on 4 nodes
    of 2 (HSDP stage 2 under the 1F1B schedule): the tp and pp groups stay inside a node or cross it as before."""
    tp_runs = {name: tiny_resolved(parallel={"dp": 4, "tp": 2, "node_size": 4}, zero=LAYOUTS[name][0],
                                   train={**LAYOUTS[name][1], "steps": STEPS}) for name in ("hsdp3", "hpz3")}
    pp_run = tiny_resolved(parallel={"dp": 4, "pp": 2, "node_size": 2}, zero={"stage": 2, "shard_group": "node"},
                           train={"micro_batch": 1, "grad_accum": 2, "steps": STEPS})

    def work():
        out = {}
        topo = Topology.build(4, 2, 1, node_size=4)
        for name, res in tp_runs.items():
            out[name] = train_run(res, topo)
        out["pp"] = train_run(pp_run, Topology.build(4, 1, 2, node_size=2))
        return out

    for rank in run_distributed(work, 8):
        for name in ("hsdp3", "hpz3", "pp"):
            assert_same_training(rank[name], reference)


def test_hsdp_and_hpz_with_context_parallelism_equal_one_process(reference):
    """dp 4 x cp 2 on 2 nodes of 4 (each node: 2 dp ranks x both cp ranks). cp ranks hold the same parameters,
    so HSDP partitions over the node's dp x cp ranks and hpZ's secondaries live there too; the chunks' replicas
    are the same (dp, cp) position on the other node. Same training as one process (fp64, 1e-10); HSDP's only
    inter-node bytes are one all-reduce of the owned chunks (a quarter of the parameters) per step."""
    runs = {"hsdp2": ({"stage": 2, "shard_group": "node"}, {"micro_batch": 1, "grad_accum": 2}),
            "hsdp3": ({"stage": 3, "shard_group": "node"}, {"micro_batch": 2}),
            "hpz3": ({"stage": 3, "hpz": True}, {"micro_batch": 1, "grad_accum": 2})}
    resolved = {name: tiny_resolved(parallel={"dp": 4, "cp": 2, "node_size": 4}, zero=zero,
                                    train={**train, "steps": STEPS}) for name, (zero, train) in runs.items()}

    def work():
        topo = Topology.build(4, cp=2, node_size=4)
        out = {"node": _members(topo.dp_cp_intra_group), "replicas": _members(topo.dp_inter_group)}
        for name, res in resolved.items():
            trainer = Trainer(res, topo)
            result = trainer.fit()
            out[name] = {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                         "params": trainer.full_state_dict()}
            trainer.train_step(STEPS)
            out[name + "-links"] = dict(trainer.zero.comm.link_bytes)
            out[name + "-numel"] = sum(b.numel for b in trainer.zero.buckets)
        return out

    got = run_distributed(work, 8)
    for rank, mine in enumerate(got):
        assert mine["node"] == ([0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7])  # global rank = 2 dp + cp
        assert mine["replicas"] == [rank % 4, rank % 4 + 4]
        for name in runs:
            assert_same_training(mine[name], reference)
        for name in ("hsdp2", "hsdp3"):  # the owned chunk (1/4 of the padded buckets) over 2 nodes, fp64
            assert mine[name + "-links"]["inter"] == pytest.approx(2 * mine[name + "-numel"] / 4 / 2 * 8, rel=1e-12)
        assert mine["hpz3-links"]["intra"] > 0  # the backward gathers ran inside the node


def test_hsdp_checkpoint_loads_into_flat_and_hsdp_layouts(tmp_path):
    """HSDP stage 3 saves after 2 steps (each chunk written once, by node 0: the replicas on the other node
    write nothing); flat ZeRO-1 and HSDP ZeRO-2 load it and finish like one process that never stopped."""
    def res(zero, run_dir, steps=3):
        return tiny_resolved(parallel={"dp": 4, "node_size": 2}, zero=zero, run={"dir": run_dir},
                             train={"micro_batch": 2, "steps": steps})

    saver = res({"stage": 3, "shard_group": "node"}, str(tmp_path / "save"))
    loaders = [res({"stage": 1}, str(tmp_path / "flat")), res({"stage": 2, "shard_group": "node"},
                                                               str(tmp_path / "hsdp"))]

    def work():
        topo = Topology.build(4, node_size=2)
        trainer = Trainer(saver, topo)
        for step in range(2):
            trainer.train_step(step)
        path = trainer.save_checkpoint(2)
        out = []
        for loader in loaders:
            resumed = Trainer(loader, topo)
            start = resumed.load_checkpoint(path)
            result = resumed.fit(start_step=start)
            out.append({"start": start, "losses": result.losses, "norms": result.grad_norms,
                        "val": result.val_loss, "params": resumed.full_state_dict()})
        return out

    ref_trainer = Trainer(tiny_resolved(train={"micro_batch": 8, "steps": 3}), Topology.solo())
    result = ref_trainer.fit()
    ref = {"losses": result.losses[2:], "norms": result.grad_norms[2:], "val": result.val_loss,
           "params": ref_trainer.full_state_dict()}
    for rank in run_distributed(work, 4):
        for got in rank:
            assert got.pop("start") == 2
            assert_same_training(got, ref)


def test_launch_refuses_a_node_size_other_than_the_processes_per_node():
    from megazoo.recipes.launch.cli import check_layout as launch_layout
    assert launch_layout(tiny_recipe(parallel={"dp": 4, "node_size": 2}), 2, 2) == 2
    assert launch_layout(tiny_recipe(parallel={"dp": 4, "node_size": 2}), 1, 4) == 4  # "nodes" simulated on one
    with pytest.raises(RecipeError, match=r"parallel.node_size = 4 but each node starts --nproc-per-node 2"):
        launch_layout(tiny_recipe(parallel={"dp": 4, "node_size": 4}), 2, 2)


def _owned_gradients_when_the_last_backward_is_flagged_or_not():
    """dp 4 on 2 nodes, HSDP stage 2, 2 micro-batches: the owned gradients and cross-node bytes are the same
    whether the last backward is flagged (cross during it) or not (cross in finish_gradients' drain)."""
    from megazoo.parallel.zero.api import ZeroEngine
    topo = Topology.build(4, node_size=2)
    out = {}
    for flagged in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).double()
        engine = ZeroEngine(model, topo, stage=2, shard_group="node", bucket_elements=64)
        engine.comm.reset()
        for micro in range(2):
            x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * topo.rank + micro))
            engine.zero.begin_micro_batch(last=flagged and micro == 1)
            model(x).square().mean().backward()
        engine.zero.finish_gradients()  # unflagged: every chunk crosses here, once
        out[flagged] = ([g.clone() for g in engine.zero.owned_grads], dict(engine.comm.link_bytes))
    return out


def test_hsdp_crosses_once_at_the_end_when_no_backward_is_flagged_last():
    for rank in run_distributed(_owned_gradients_when_the_last_backward_is_flagged_or_not, 4):
        (flagged, links), (unflagged, links_unflagged) = rank[True], rank[False]
        assert links["inter"] == links_unflagged["inter"] > 0
        for a, b in zip(flagged, unflagged):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
