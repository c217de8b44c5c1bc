"""ZeRO mixed precision (bf16, fp16 + dynamic loss scaling), CPU offload, and measured communication."""

from __future__ import annotations

import math

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_resolved
from parity_helpers import assert_same_training, train_run

from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.loss_scaler import DynamicLossScaler
from megazoo.recipes.planner.zero import communication_volume
from megazoo.recipes.training.trainer import Trainer


def test_loss_scaler_hysteresis_backoff_and_growth():
    scaler = DynamicLossScaler(initial_scale=1024.0, growth_interval=3, hysteresis=2, min_scale=256.0)
    scaler.update(overflow=True)
    assert scaler.scale == 1024.0  # the first overflow is absorbed by the hysteresis
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    scaler.update(overflow=True)
    assert scaler.scale == 256.0
    scaler.update(overflow=True)
    assert scaler.scale == 256.0  # never below min_scale
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 512.0  # growth after growth_interval good steps
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 512.0


def _fp16_with_injected_inf(stage: int):
    """4 fp16 steps; at step 1 dp rank 1 alone gets an inf gradient. Returns what each rank saw."""
    res = tiny_resolved(parallel={"dp": 2}, train={"micro_batch": 4, "precision": "fp16", "steps": 4},
                        zero={"stage": stage}, loss_scale={"hysteresis": 1})
    topo = Topology.build(2, 1)
    trainer = Trainer(res, topo)
    poison = {"on": False}
    param = trainer.model.h["0"].mlp.c_fc.weight
    param.register_hook(lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)
    metrics, snapshots = [], []
    for step in range(4):
        poison["on"] = step == 1 and topo.dp_rank == 1
        metrics.append(trainer.train_step(step))
        snapshots.append(trainer.full_state_dict())
    dtypes = {p.dtype for p in trainer.model.parameters()}
    return metrics, snapshots, dtypes


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_overflow_skips_the_step_on_every_rank(stage):
    for metrics, snapshots, dtypes in run_distributed(_fp16_with_injected_inf, 2, stage):
        assert [m["skipped"] for m in metrics] == [False, True, False, False]
        assert metrics[0]["loss_scale"] == 65536.0 and metrics[2]["loss_scale"] == 32768.0  # halved
        for name, before in snapshots[0].items():  # the bad step left every parameter untouched
            assert torch.equal(snapshots[1][name], before), name
        assert any(not torch.equal(snapshots[2][n], snapshots[1][n]) for n in snapshots[1])  # training goes on
        assert all(math.isfinite(m["loss"]) for m in metrics)
        assert dtypes == ({torch.float32} if stage == 0 else {torch.float16})  # ZeRO stores fp16 parameters


def test_consecutive_overflows_abort_with_a_clear_message():
    res = tiny_resolved(train={"precision": "fp16", "steps": 5}, zero={"stage": 1},
                        loss_scale={"max_consecutive_skips": 3})
    trainer = Trainer(res, Topology.solo())
    trainer.model.wpe.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    with pytest.raises(FloatingPointError, match="3 consecutive steps overflowed in fp16"):
        trainer.fit()


def _bf16_zero2():
    res = tiny_resolved(parallel={"dp": 2}, train={"micro_batch": 4, "precision": "bf16"}, zero={"stage": 2})
    trainer = Trainer(res, Topology.build(2, 1))
    losses = trainer.fit().losses
    return losses, {p.dtype for p in trainer.model.parameters()}, {m.dtype for m in trainer.zero.masters}


def test_bf16_zero2_keeps_fp32_masters_and_tracks_fp32():
    fp32 = train_run(tiny_resolved(train={"micro_batch": 8, "precision": "fp32"}), Topology.solo())["losses"]
    for losses, param_dtypes, master_dtypes in run_distributed(_bf16_zero2, 2):
        assert param_dtypes == {torch.bfloat16} and master_dtypes == {torch.float32}
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=3e-2, atol=0)


def _offloaded(stage):
    res = tiny_resolved(parallel={"dp": 2}, train={"micro_batch": 4}, zero={"stage": stage, "offload": "cpu"})
    trainer = Trainer(res, Topology.build(2, 1))
    result = trainer.fit()
    return ({"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
             "params": trainer.full_state_dict()},
            {t.device.type for t in trainer.zero.masters + trainer.zero.owned_grads}, trainer.zero.offload)


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_equals_reference(stage):
    """On a CPU-only machine the offload target is the compute device: the path runs, trivially."""
    reference = train_run(tiny_resolved(train={"micro_batch": 8}), Topology.solo())
    for got, devices, offload in run_distributed(_offloaded, 2, stage):
        assert offload == "cpu" and devices == {"cpu"}
        assert_same_training(got, reference)


def _measured_comm(dp: int, stage: int, grad_accum: int):
    res = tiny_resolved(parallel={"dp": dp}, train={"micro_batch": 8 // (dp * grad_accum), "grad_accum": grad_accum,
                                                    "precision": "fp32", "steps": 2}, zero={"stage": stage})
    trainer = Trainer(res, Topology.build(dp, 1))
    trainer.train_step(0)
    trainer.train_step(1)  # the first step also runs ZeRO-3's one-off order checks
    n_params = sum(p.numel() for p in trainer.model.parameters())
    root = sum(p.numel() for name, p in trainer.model.named_parameters() if not name.startswith("h."))
    return dict(trainer.zero.comm.elements), n_params, root


@pytest.mark.parametrize("dp, stage, grad_accum", [(2, 0, 1), (2, 1, 2), (2, 2, 2), (4, 2, 1), (2, 3, 2),
                                                   (4, 3, 1)])
def test_measured_communication_matches_the_planner(dp, stage, grad_accum):
    """Elements each rank sends per step, as counted at the collectives, against the ZeRO paper's volume:
    2 x params x (dp-1)/dp for stages 0-2 (stage 2: one reduce-scatter per micro-batch), 3 x for stage 3.
    Stage 3 keeps its root unit (embeddings, final LayerNorm) gathered from forward through backward, so it
    sends the root's all-gather once per micro-batch instead of twice: planner - root x (dp-1)/dp each."""
    for elements, n_params, root in run_distributed(_measured_comm, dp, dp, stage, grad_accum):
        plan = communication_volume(n_params, dp, stage, grad_accum=grad_accum)
        expected = plan.elements - (grad_accum * root * (dp - 1) / dp if stage == 3 else 0)
        norm_all_reduce = 2 * 2 * (dp - 1) / dp if stage else 0  # the gradient-norm all-reduce of 2 numbers
        measured = sum(elements.values())
        assert measured == pytest.approx(expected + norm_all_reduce, rel=2e-3)  # bucket padding only
        if stage == 0:
            assert set(elements) == {"all_reduce"}
        else:
            assert {"reduce_scatter", "all_gather"} <= set(elements)
