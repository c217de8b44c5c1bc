"""DiLoCo ([diloco], parallel/fault_tolerance/diloco.py) at 2 groups (nodes) x 1 rank, fp64, against a
single-process reference of the algorithm written here: one solo Trainer per group reading that group's share of
every global batch (its inner AdamW steps), and every H steps the outer step by hand on flat copies of the
parameters laid out as the run's buckets (the same chunks the compressors see): delta_g = anchor - params_g,
the groups' mean (or the same compressor applied to each group's delta with its own error buffers),
Nesterov SGD (buf = mu buf + d, anchor -= lr (d + mu buf)), every group's parameters = anchor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from recipe_helpers import tiny_recipe, tiny_resolved

import megazoo.parallel.collectives as collectives
from megazoo.data.batches import GlobalBatchSampler
from megazoo.parallel.compressed.comms import padded_numel
from megazoo.parallel.compressed.packing import decode, encode
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.quantized import dequantize_blocks, quantize_blocks
from megazoo.recipes.config import RecipeError
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.trainer import Trainer

H, STEPS, GROUPS, MICRO = 3, 10, 2, 2  # 3 outer steps, then one inner step where the groups differ again
OUTER = {"enabled": True, "inner_steps": H, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
COMPRESSIONS = ("none", "onebit", "int8")


def _res(compression: str, stage: int = 1, **more):
    zero = {"stage": stage, "shard_group": "node" if stage else "dp"}
    return tiny_resolved(parallel={"dp": GROUPS, "node_size": 1}, zero=zero,
                         train={"steps": STEPS, "micro_batch": MICRO, **more.pop("train", {})},
                         diloco={**OUTER, "compression": compression}, **more)


def _count_inter_collectives(topo: Topology, counter: list[int]) -> None:
    """Count every collective issued over the cross-node group (dp_inter_group), whatever the wrapper."""
    def wrap(owner, name, group_at):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            group = kwargs.get("group", args[group_at] if len(args) > group_at else None)
            counter[0] += group is topo.dp_inter_group
            return original(*args, **kwargs)
        setattr(owner, name, counted)
    for owner, name, at in ((dist, "all_reduce", 2), (dist, "all_to_all_single", 4), (dist, "broadcast", 2),
                            (collectives, "_all_gather_single", 2), (collectives, "_exchange_all_gather", 2),
                            (collectives, "_reduce_scatter_single", 3), (collectives, "_exchange_reduce_scatter", 2)):
        wrap(owner, name, at)


@pytest.fixture(scope="module")
def runs():
    resolved = {**{c: _res(c) for c in COMPRESSIONS}, **{f"stage0-{c}": _res(c, stage=0) for c in COMPRESSIONS}}

    def work():
        topo = Topology.build(GROUPS, node_size=1)
        counter, out = [0], {}
        _count_inter_collectives(topo, counter)
        for name, res in resolved.items():
            torch.manual_seed(0)
            trainer = Trainer(res, topo)
            losses, calls, outer = [], [], []
            for step in range(STEPS):
                before = counter[0]
                metrics = trainer.train_step(step)
                losses.append(metrics["loss"])
                outer.append(metrics["diloco_outer_steps"])
                calls.append(counter[0] - before)
            buckets = getattr(trainer.zero.inner, "buckets", None)  # stage 0: one chunk per parameter
            out[name] = {"losses": losses, "calls": calls, "outer": outer, "params": trainer.full_state_dict(),
                         "buckets": buckets and [(list(b.names), list(b.offsets), b.numel) for b in buckets],
                         "chunks": len(trainer.zero.anchors)}
        return out

    return run_distributed(work, GROUPS)


def _onebit_mean(x, worker_error, server_error):
    """comms.compressed_all_reduce of GROUPS workers, in one process: x[g] padded flats, errors updated in place."""
    c = x[0].numel() // GROUPS
    wires = []
    for g in range(GROUPS):
        y = (x[g] + worker_error[g]).view(GROUPS, c)
        wire, sent = encode(y)
        worker_error[g].copy_((y - sent).view(-1))
        wires.append(wire)
    out = []
    for r in range(GROUPS):  # rank r serves chunk r: the mean of what every worker sent it
        z = torch.stack([decode(wires[g][r:r + 1], x[0].dtype).view(c) for g in range(GROUPS)]).sum(dim=0)
        z = z.div_(GROUPS).add_(server_error[r])
        wire, sent = encode(z.view(1, c))
        server_error[r].copy_(z - sent.view(c))
        out.append(decode(wire, x[0].dtype).view(c))
    return torch.cat(out)


def reference(compression: str, buckets, steps: int = STEPS, per_group: int = 1, stage: int = 1):
    """Losses (mean over groups) and each group's parameters, by the algorithm above; a group of `per_group`
    ranks reads their micro-batches as one (the ranks' mean loss and gradient)."""
    # ZeRO-1 on one rank: the run's bucket layout and flat AdamW, so the deltas are bitwise the run's (sign and
    # rounding compressors are discontinuous: a 1e-17 difference in a near-zero delta, e.g. the attention key's
    # bias whose gradient is zero up to rounding, flips its sign bit)
    res = tiny_resolved(train={"steps": STEPS, "micro_batch": MICRO * per_group}, zero={"stage": stage})
    trainers = []
    for g in range(GROUPS):
        torch.manual_seed(0)
        t = Trainer(res, Topology.solo())
        t.sampler = GlobalBatchSampler(len(t.data.train), MICRO * per_group * GROUPS, MICRO * per_group, 1, g, GROUPS,
                                       seed=res.recipe.train.seed)
        trainers.append(t)
    params = [dict(t.model.named_parameters()) for t in trainers]

    if buckets is None:  # stage 0's chunks, and any layout for plain averaging (elementwise): each parameter
        buckets = [([name], [0], p.numel()) for name, p in params[0].items()]

    def flats(g):
        out = []
        for names, offsets, numel in buckets:
            flat = torch.zeros(numel, dtype=torch.float64)
            for name, off in zip(names, offsets):
                flat[off:off + params[g][name].numel()] = params[g][name].detach().view(-1)
            out.append(flat)
        return out

    anchors, momentum = flats(0), [None] * len(buckets)
    errors = [[torch.zeros(padded_numel(n, GROUPS) if compression == "onebit" else n, dtype=torch.float64)
               for _, _, n in buckets] for _ in range(GROUPS)]
    server = [[torch.zeros(padded_numel(n, GROUPS) // GROUPS, dtype=torch.float64) for _ in range(GROUPS)]
              for _, _, n in buckets]
    losses = []
    for step in range(steps):
        losses.append(sum(t.train_step(step)["loss"] for t in trainers) / GROUPS)
        if (step + 1) % H:
            continue
        current = [flats(g) for g in range(GROUPS)]
        for k, (names, offsets, n) in enumerate(buckets):
            deltas = [anchors[k] - current[g][k] for g in range(GROUPS)]
            if compression == "none":
                d = sum(deltas) / GROUPS
            elif compression == "int8":
                sent = []
                for g in range(GROUPS):
                    y = deltas[g] + errors[g][k]
                    q, s = quantize_blocks(y)
                    sent.append(dequantize_blocks(q, s)[:n])
                    errors[g][k] = y - sent[-1]
                d = sum(sent) / GROUPS
            else:
                padded = [torch.cat([x, torch.zeros(errors[0][k].numel() - n, dtype=x.dtype)]) for x in deltas]
                d = _onebit_mean(padded, [errors[g][k] for g in range(GROUPS)], server[k])[:n]
            momentum[k] = d.clone() if momentum[k] is None else momentum[k] * OUTER["outer_momentum"] + d
            anchors[k] = anchors[k] - OUTER["outer_lr"] * (d + OUTER["outer_momentum"] * momentum[k])
            with torch.no_grad():
                for g in range(GROUPS):
                    for name, off in zip(names, offsets):
                        p = params[g][name]
                        p.copy_(anchors[k][off:off + p.numel()].view_as(p))
    return losses, [t.full_state_dict() for t in trainers]


@pytest.mark.parametrize("stage", [1, 0])
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_diloco_equals_the_single_process_reference(runs, compression, stage):
    name = compression if stage else f"stage0-{compression}"
    ref_losses, ref_params = reference(compression, runs[0][name]["buckets"], stage=stage)
    for g, rank in enumerate(runs):
        got = rank[name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-10, atol=0)
        assert got["params"].keys() == ref_params[g].keys()
        for param, value in ref_params[g].items():
            torch.testing.assert_close(got["params"][param], value, rtol=0, atol=1e-10, msg=param)
    # the last step was an inner one: the groups trained apart (a run that averaged every step would not differ)
    assert any(not torch.equal(runs[0][name]["params"][n], runs[1][name]["params"][n]) for n in ref_params[0])


@pytest.mark.parametrize("name", [*COMPRESSIONS, *(f"stage0-{c}" for c in COMPRESSIONS)])
def test_the_groups_talk_only_every_h_steps(runs, name):
    per_sync = runs[0][name]["chunks"] * (1 if name.endswith("none") else 2)
    expected = [per_sync if (step + 1) % H == 0 else 0 for step in range(STEPS)]
    for rank in runs:
        assert rank[name]["calls"] == expected
        assert rank[name]["outer"] == [(step + 1) // H for step in range(STEPS)]  # metrics.jsonl's count


def test_two_groups_of_two_zero2_ranks_equal_the_reference():
    """HSDP's sharded layout: each node's 2 ranks own half of every bucket (ZeRO-2), and each rank's outer step
    runs on its own chunk with the chunk's owner on the other node."""
    res = tiny_resolved(parallel={"dp": 4, "node_size": 2}, zero={"stage": 2, "shard_group": "node"},
                        train={"steps": STEPS, "micro_batch": MICRO}, diloco=OUTER)

    def work():
        topo = Topology.build(4, node_size=2)
        torch.manual_seed(0)
        trainer = Trainer(res, topo)
        losses = [trainer.train_step(step)["loss"] for step in range(STEPS)]
        owned = [b.owned.stop - b.owned.start for b in trainer.zero.buckets]
        return {"losses": losses, "params": trainer.full_state_dict(), "owned": owned,
                "numel": [b.numel for b in trainer.zero.buckets]}

    runs = run_distributed(work, 4)
    ref_losses, ref_params = reference("none", None, per_group=2)
    for rank, got in enumerate(runs):
        assert got["owned"] == [n // 2 for n in got["numel"]]  # sharded inside the node
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-10, atol=0)
        for name, value in ref_params[rank // 2].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("stage, compression", [(1, "onebit"), (0, "int8")])
def test_checkpoint_resumes_the_outer_state_exactly(tmp_path, stage, compression):
    """Saved after 4 steps (one outer step, one inner step past it: anchor, Nesterov momentum, the compressor's
    error buffers and each group's own inner state all in play), loaded into a fresh run that finishes: bitwise
    the run that never stopped."""
    res = _res(compression, stage=stage, run={"dir": str(tmp_path / "run")})

    def work():
        topo = Topology.build(GROUPS, node_size=1)
        torch.manual_seed(0)
        straight = Trainer(res, topo)
        losses = [straight.train_step(step)["loss"] for step in range(STEPS)]
        torch.manual_seed(0)
        first = Trainer(res, topo)
        for step in range(4):
            first.train_step(step)
        path = first.save_checkpoint(4)
        saved = first.zero.rank_state()["diloco"]
        torch.manual_seed(1)  # a different start: everything must come from the checkpoint
        resumed = Trainer(res, topo)
        start = resumed.load_checkpoint(path)
        loaded = resumed.zero.rank_state()["diloco"]
        keys = ("anchors", "momentum", "worker_error", "server_error", "error", "masters", "exp_avg", "exp_avg_sq")
        same_state = all(len(saved[key]) == len(loaded[key]) for key in keys) and all(
            torch.equal(a, b) for key in keys for a, b in zip(saved[key], loaded[key]))
        errors = saved["worker_error"] + saved["error"]
        same_state &= bool(errors) and all(bool(e.abs().sum() > 0) for e in errors)  # feedback is in play
        weights_only = Trainer(res, topo)  # a fine-tune's start: the loaded weights are the last sync point
        weights_only.load_checkpoint(path, load_optimizer=False)
        z = weights_only.zero
        anchored = all(torch.equal(a, m) for a, m in zip(z.anchors, z.inner.masters)) and z.since_sync == 0
        more = [resumed.train_step(step)["loss"] for step in range(start, STEPS)]
        a, b = straight.full_state_dict(), resumed.full_state_dict()
        return {"start": start, "since_sync": loaded["since_sync"], "same_state": same_state, "anchored": anchored,
                "momentum_set": all(m is not None and bool(m.abs().sum() > 0) for m in saved["momentum"]),
                "losses": losses[4:] == more, "params": all(torch.equal(a[n], b[n]) for n in a)}

    for rank in run_distributed(work, GROUPS):
        assert rank == {"start": 4, "since_sync": 1, "same_state": True, "momentum_set": True, "losses": True,
                        "params": True, "anchored": True}


@pytest.mark.parametrize("diloco, more, message", [
    ({"inner_steps": 0}, {}, "diloco.inner_steps = 0 is invalid; valid: an integer >= 1"),
    ({"outer_lr": -1.0}, {}, "diloco.outer_lr = -1.0 is invalid; valid: a number > 0"),
    ({"outer_momentum": 1.0}, {}, "diloco.outer_momentum = 1.0 is invalid; valid: 0 <= momentum < 1"),
    ({"compression": "int4"}, {}, "diloco.compression = 'int4' is invalid; valid: 'none', 'onebit', 'int8'"),
    ({}, {"zero": {"stage": 3, "shard_group": "node"}}, "diloco with zero.stage = 3 is not supported; valid: 0, 1, 2"),
    ({}, {"zero": {"stage": 1, "shard_group": "dp"}}, "diloco with zero.shard_group = 'dp' is invalid"),
    ({}, {"parallel": {"dp": 2, "node_size": 2}}, "diloco with parallel.node_size = 2 puts all of parallel.dp = 2"),
    ({}, {"parallel": {"dp": 2, "node_size": 0}}, "diloco with parallel.node_size = 0 is invalid"),
    ({}, {"optimizer": {"name": "onebit_adam"}}, "diloco with optimizer.name = 'onebit_adam' is not supported"),
])
def test_bad_settings_are_refused_before_any_process_starts(diloco, more, message):
    sections = {"parallel": {"dp": 2, "node_size": 1}, "zero": {"stage": 1, "shard_group": "node"}, **more}
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(tiny_recipe(diloco={"enabled": True, **diloco}, **sections))


def test_unknown_diloco_keys_are_refused():
    with pytest.raises(RecipeError, match="unknown recipe key.*diloco.inner_step"):
        tiny_recipe(diloco={"inner_step": 3})
