"""ZeroEngine trains a Hugging Face GPT2LMHeadModel exactly like a plain single-process AdamW loop.

The reference is the textbook loop (full batch, torch AdamW with GPT-2 decay groups, clip_grad_norm_, a
LambdaLR warmup). The engine loop is that loop with the optimizer/scheduler lines replaced by the engine and
`loss.backward(); clip; step; zero_grad; scheduler.step()` replaced by `engine.backward(loss); engine.step()`,
run on 2 dp ranks under every ZeRO stage. fp64, dropout off: losses and final full parameters agree to 1e-10.
The tied lm_head / wte weight must stay one parameter through every stage.
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import run_distributed
from zero_helpers import BATCH, CLIP, LR, SEQ, STEPS, TOL, WD, batches, lm_loss, tiny_gpt2

from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.api import ZeroEngine, default_units
from megazoo.parallel.zero.loss_scaler import DynamicLossScaler

transformers = pytest.importorskip("transformers")


def warmup(step: int) -> float:  # LambdaLR factor: linear warmup over 3 steps
    return min(1.0, (step + 1) / 3)


def reference_training() -> dict:
    data = batches()
    model = tiny_gpt2()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    losses, norms = [], []
    for step in range(len(data)):
        batch = data[step]
        loss = lm_loss(model(input_ids=batch).logits, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        norms.append(norm)
    return {"losses": losses, "norms": [float(n) for n in norms],
            "params": {k: v.clone() for k, v in model.state_dict().items()}}


def engine_training(stage: int, grad_accum: int, meta: bool = False, loss_scaler=None, *, dp: int = 2,
                    node_size: int = 0, topo: Topology | None = None, bypass_qgz: bool = False, **node_aware) -> dict:
    """The reference loop on this dp rank's share of each batch, as grad_accum micro-batches per step. The
    loop differs from the reference only in the engine line and engine.backward / engine.step. `node_aware`:
    ZeroEngine's shard_group / hpz / quantized_weights / quantized_gradients; `bypass_qgz`: qgZ's hierarchical
    all-to-alls with unquantized values on the wire (then exact)."""
    topo = topo or Topology.build(dp=dp, node_size=node_size)
    share = batches()[:, topo.dp_rank * BATCH // dp:(topo.dp_rank + 1) * BATCH // dp]
    data = share.reshape(STEPS * grad_accum, -1, SEQ)  # this rank's micro-batches, in order
    init_fn = None
    if meta:  # built on the meta device; stage 3 materialises one unit at a time from the reference init
        full = tiny_gpt2().state_dict()
        init_fn = lambda owner, name, tensor, spec: tensor.copy_(full[name])  # noqa: E731
    model = tiny_gpt2("meta" if meta else None)
    engine = ZeroEngine(model, topo, stage=stage, lr=LR, weight_decay=WD, grad_clip=CLIP, grad_accum=grad_accum,
                        lr_schedule=lambda step: LR * warmup(step), init_fn=init_fn, loss_scaler=loss_scaler,
                        **node_aware)
    if bypass_qgz:
        engine.zero.reducer.hierarchical.bits = "none"
    losses, norms = [], []
    for step in range(len(data)):
        batch = data[step]
        loss = lm_loss(model(input_ids=batch).logits, batch)
        engine.backward(loss)
        norm = engine.step()  # None between accumulation boundaries
        losses.append(loss.item())
        norms.append(norm)
    return {"losses": losses, "norms": [n for n in norms if n is not None], "params": engine.full_state_dict(),
            "tied": model.lm_head.weight is model.transformer.wte.weight, "steps": engine.step_count,
            "skipped": engine.skipped_steps, "memory": engine.memory_bytes(),
            "n_params": sum(p.numel() for p in model.parameters()), "kinds": sorted(engine.comm.bytes),
            "links": dict(engine.comm.link_bytes), "groups": _groups(engine)}


def _groups(engine: ZeroEngine) -> dict:
    groups = getattr(engine.zero, "groups", None)  # stage 0 partitions nothing
    return {} if groups is None else {"shard": groups.shard_size, "replicas": groups.replica_size,
                                      "secondary": groups.secondary_size, "hpz": groups.hpz}


def assert_matches_reference(results: list[dict], ref: dict, grad_accum: int) -> None:
    # The reference loss is the full-batch mean: the mean over dp ranks and micro-batches (equal token counts).
    per_rank = torch.tensor([r["losses"] for r in results], dtype=torch.float64).view(len(results), STEPS, grad_accum)
    torch.testing.assert_close(per_rank.mean(dim=(0, 2)), torch.tensor(ref["losses"], dtype=torch.float64),
                               rtol=TOL, atol=0)
    for got in results:
        assert got["tied"], "lm_head.weight must still be transformer.wte.weight"
        assert got["steps"] == STEPS
        torch.testing.assert_close(torch.tensor(got["norms"], dtype=torch.float64),
                                   torch.tensor(ref["norms"], dtype=torch.float64), rtol=TOL, atol=0)
        assert got["params"].keys() == ref["params"].keys()
        for name, value in ref["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=TOL, msg=name)


@pytest.fixture(scope="module")
def reference():
    ref = reference_training()
    assert ref["losses"][-1] < ref["losses"][0]
    assert max(ref["norms"]) > CLIP  # clipping is active on some steps
    return ref


@pytest.mark.parametrize("stage, grad_accum", [(0, 1), (1, 1), (2, 1), (3, 1), (2, 2), (3, 2)])
def test_engine_equals_single_process_adamw(reference, stage, grad_accum):
    results = run_distributed(engine_training, 2, stage, grad_accum)
    assert_matches_reference(results, reference, grad_accum)
    for got in results:  # between steps a stage-3 rank holds half the parameters (fp64: 8 bytes each)
        full_bytes = 8 * got["n_params"]
        assert got["memory"]["params"] <= (0.5 if stage == 3 else 1.0) * full_bytes + 8 * 64


NODE_AWARE = {  # name -> (stage, ZeroEngine keywords): dp 4 on 2 "nodes" of 2, 2 micro-batches per step
    "hsdp2": (2, {"shard_group": "node"}), "hsdp3": (3, {"shard_group": "node"}), "hpz3": (3, {"hpz": True}),
    "qgz1-bypassed": (1, {"quantized_gradients": "int8", "bypass_qgz": True}),
    "qgz2": (2, {"quantized_gradients": "int8"}),
    "hpz-qwz-qgz3": (3, {"hpz": True, "quantized_weights": True, "quantized_gradients": "int4"}),
}  # (HSDP stage 1 and qwZ alone take the same keyword path; the Trainer's tests run each layout)


def _node_aware_runs() -> dict:
    topo = Topology.build(dp=4, node_size=2)
    return {name: engine_training(stage, 2, dp=4, topo=topo, **kw) for name, (stage, kw) in NODE_AWARE.items()}


@pytest.fixture(scope="module")
def node_aware():
    return run_distributed(_node_aware_runs, 4)


@pytest.mark.parametrize("name", ["hsdp2", "hsdp3", "hpz3", "qgz1-bypassed"])
def test_engine_node_aware_layouts_equal_single_process_adamw(node_aware, reference, name):
    """HSDP, hpZ and qgZ's hierarchical reduce (unquantized on the wire) through ZeroEngine: the same training
    as one process, fp64, 1e-10."""
    results = [rank[name] for rank in node_aware]
    assert_matches_reference(results, reference, 2)
    for got in results:
        groups = got["groups"]
        if name.startswith("hsdp"):  # partitioned over the node's 2 ranks, replicated over the 2 nodes
            assert (groups["shard"], groups["replicas"]) == (2, 2)
            assert got["links"]["inter"] < got["links"]["intra"]
        if name == "hpz3":
            assert groups["hpz"] and groups["secondary"] == 2 and got["links"]["intra"] > 0
        if name == "qgz1-bypassed":
            assert "all_to_all" in got["kinds"] and "reduce_scatter" not in got["kinds"]


@pytest.mark.parametrize("name, kinds", [("qgz2", ["all_to_all_int8"]),
                                         ("hpz-qwz-qgz3", ["all_gather_int8", "all_to_all_int4"])])
def test_engine_quantized_layouts_train_close_to_exact(node_aware, reference, name, kinds):
    """qgZ / qwZ through ZeroEngine: the quantized collectives run and the losses stay within 1% of the exact
    run's (the bound test_qwz.py holds the Trainer to); qgZ's first loss precedes any quantized update: exact."""
    results = [rank[name] for rank in node_aware]
    losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).view(len(results), STEPS, 2)
    ref = torch.tensor(reference["losses"], dtype=torch.float64)
    rel = ((losses.mean(dim=(0, 2)) - ref).abs() / ref).tolist()
    assert 0 < max(rel) < 1e-2, rel
    if "qwz" not in name:
        assert rel[0] < 1e-12
    for got in results:
        assert set(kinds) <= set(got["kinds"]) and got["steps"] == STEPS and got["tied"]
    assert results[0]["groups"]["shard"] == 4


def test_engine_refuses_node_aware_choices_that_do_not_fit():
    with pytest.raises(ValueError, match=r"zero.hpz = true needs zero.stage = 3 \(got 2\)"):
        ZeroEngine(torch.nn.Linear(2, 2), Topology.solo(), stage=2, hpz=True)
    with pytest.raises(ValueError, match=r"zero.quantized_weights = true needs zero.stage = 3"):
        ZeroEngine(torch.nn.Linear(2, 2), Topology.solo(), stage=1, quantized_weights=True)
    with pytest.raises(ValueError, match=r"zero.shard_group = 'rack' is invalid; valid: 'dp', 'node'"):
        ZeroEngine(torch.nn.Linear(2, 2), Topology.solo(), stage=1, shard_group="rack")


def test_stage3_materialises_a_meta_model_and_reties_the_head(reference):
    assert_matches_reference(run_distributed(engine_training, 2, 3, 1, meta=True), reference, 1)


def test_loss_scaler_is_exact_with_a_power_of_two_scale(reference):
    """Multiplying the loss by 2^12 and the gradients by 2^-12 is exact in floating point: nothing changes."""
    scaler = DynamicLossScaler(initial_scale=2.0 ** 12)
    assert_matches_reference(run_distributed(engine_training, 2, 2, 1, loss_scaler=scaler), reference, 1)


def _overflowing_first_step():
    torch.set_num_threads(1)
    model = tiny_gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # 2^1023 x loss overflows fp64: the first step must be skipped; the scale then backs off to 2^10.
    scaler = DynamicLossScaler(initial_scale=2.0 ** 1023, hysteresis=1, backoff=2.0 ** -1013)
    engine = ZeroEngine(model, Topology.build(dp=2), stage=3, lr=LR, loss_scaler=scaler)
    batch = batches()[0, :4]
    engine.backward(lm_loss(model(input_ids=batch).logits, batch))
    first = engine.step()
    unchanged = all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    engine.backward(lm_loss(model(input_ids=batch).logits, batch))
    second = engine.step()
    changed = any(not torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    return first, second, unchanged, changed, engine.skipped_steps, engine.step_count, scaler.scale


def test_fp16_overflow_skips_the_step_on_every_rank():
    for first, second, unchanged, changed, skipped, steps, scale in run_distributed(_overflowing_first_step, 2):
        assert math.isnan(first) and math.isfinite(second)
        assert unchanged and changed and skipped == 1 and steps == 1 and scale == 2.0 ** 10


def _fp16_training(stage: int):
    torch.set_num_threads(1)
    model = tiny_gpt2().half()  # fp16 storage; the partitioned optimizer keeps fp32 masters
    engine = ZeroEngine(model, Topology.build(dp=2), stage=stage, lr=LR, grad_clip=1.0,
                        loss_scaler=DynamicLossScaler())
    data, losses = batches(), []
    for step in range(10):
        batch = data[step % 2, :4]
        loss = lm_loss(model(input_ids=batch).logits.float(), batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.step_count + engine.skipped_steps, model.transformer.h[0].mlp.c_fc.weight.dtype


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_with_dynamic_loss_scaling_learns(stage):
    for losses, steps, dtype in run_distributed(_fp16_training, 2, stage):
        assert dtype == torch.float16 and steps == 10
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5


def test_default_units_are_the_transformer_blocks():
    model = tiny_gpt2()
    assert default_units(model) == list(model.transformer.h)
    assert default_units(torch.nn.Linear(2, 2)) == []


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="stage = 4 is invalid; valid: 0, 1, 2, 3"):
        ZeroEngine(torch.nn.Linear(2, 2), Topology.solo(), stage=4)
    with pytest.raises(ValueError, match="meta-device parameters: pass init_fn"):
        ZeroEngine(tiny_gpt2("meta"), Topology.solo(), stage=3)


def test_the_engine_moves_the_model_to_the_topology_device(monkeypatch):
    """A model built on the CPU for a GPU job is moved before anything is broadcast or bucketed (the device is
    faked: the move is recorded and stops the construction)."""
    model = torch.nn.Linear(4, 4)
    moved = []

    class Moved(Exception):
        pass

    def record(device):
        moved.append(torch.device(device))
        raise Moved

    monkeypatch.setattr(model, "to", record)
    with pytest.raises(Moved):
        ZeroEngine(model, Topology.solo(torch.device("cuda", 3)), stage=2)
    assert moved == [torch.device("cuda", 3)]
    # Already on the topology's device: nothing to move.
    same = torch.nn.Linear(4, 4)
    monkeypatch.setattr(same, "to", record)
    ZeroEngine(same, Topology.solo(), stage=0)
