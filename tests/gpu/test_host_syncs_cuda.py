"""Host-sync budget of one training step on the GPU (DESIGN principle 9: no host sync in the hot path beyond
the metrics'). torch's sync debug mode warns at every operation that makes the host wait for the GPU (.item(),
device-to-host copies, nonzero, boolean-mask indexing, ...); one warmed-up `Trainer.train_step` runs under it.

The budget, counted from recipes/training/trainer.py `train_step` (dp = pp = 1, no fp16 scaler, no offload):
  1. `_host_values(...)` -> `packed.tolist()`   the step's loss, grad norm and agreed stop, read together
Nothing else reads a device value on the host: the batches go up with non_blocking copies, clipping multiplies by
a device tensor, AdamW (torch fused) keeps its step counts on the GPU, peak memory is the allocator's counter.
NOT YET MEASURED: no GPU has run this yet. The test prints the observed count and where each sync happened;
record the first GPU run's number here if it is lower (a tighter budget), never raise it without a reason.

(The torch cross-entropy backward used to index with nonzero(): two syncs per micro-batch and chunk; it now
scatters, so every cross-entropy implementation is held to the same budget.)
"""

import warnings

import pytest
import torch
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

pytestmark = pytest.mark.cuda

METRIC_READS = 1  # the one packed read of loss, grad norm and stop: the design budget, counted from the code
GRAD_ACCUM = 2  # more than one micro-batch, so a per-micro-batch sync shows up as a multiple


def count_syncs(fn) -> list[str]:
    """Where each synchronizing CUDA operation happened while fn() ran."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "called a synchronizing CUDA operation" in str(w.message)]


def test_the_counter_sees_a_sync():
    """The budget test is only as good as its counter: one .item() must count exactly once."""
    x = torch.ones(3, device="cuda")
    assert len(count_syncs(lambda: x.sum().item())) == 1
    assert count_syncs(lambda: x.mul_(2)) == []  # a kernel launch alone does not wait


CE = [pytest.param("triton", id="ce-triton"), pytest.param("torch", id="ce-torch"),
      pytest.param("reference", id="ce-reference")]


@pytest.mark.parametrize("cross_entropy", CE)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_train_step_syncs_only_for_its_metrics(tmp_path, stage, cross_entropy):
    if cross_entropy == "triton":
        pytest.importorskip("triton")
    res = tiny_resolved(train={"precision": "bf16", "micro_batch": 4, "grad_accum": GRAD_ACCUM},
                        zero={"stage": stage}, run={"dir": str(tmp_path)},
                        kernels={"adamw": "torch", "cross_entropy": cross_entropy})
    trainer = Trainer(res, Topology.solo(torch.device("cuda", 0)))
    for step in range(2):  # warm-up: Triton compilation, allocator growth, ZeRO-3's first-step order check
        trainer.train_step(step)
    metrics = {}
    syncs = count_syncs(lambda: metrics.update(trainer.train_step(2)))
    print(f"\nstage {stage}, cross_entropy {cross_entropy}: {len(syncs)} host syncs in one step "
          f"(budget {METRIC_READS}):\n" + "\n".join(syncs))
    assert metrics["step"] == 2 and metrics["loss"] > 0  # the step ran
    assert len(syncs) >= 1, "the step reads its loss on the host: the counter must see at least that"
    assert len(syncs) <= METRIC_READS, f"{len(syncs)} host syncs in one step, budget {METRIC_READS}:\n" + \
        "\n".join(syncs)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_moe_train_step_syncs_only_for_its_metrics(tmp_path, capacity_factor):
    """An MoE model at ep 1 (grouped matmul in bf16): routing, sorting, capacity's padded slots and the step's MoE
    figures (recipes/training/moe_metrics.py, read with the loss) add no sync. (ep > 1 adds one per MoE layer
    forward, the all-to-all's split sizes: tests/recipes/training/test_moe_host_reads.py counts it on CPU.)"""
    moe = {"preset": "llama-tiny", "n_layer": 2, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": 64,
           "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001, "moe_capacity_factor": capacity_factor}
    res = tiny_resolved(model=moe, train={"precision": "bf16", "micro_batch": 4, "grad_accum": GRAD_ACCUM},
                        run={"dir": str(tmp_path)}, kernels={"adamw": "torch"})
    trainer = Trainer(res, Topology.solo(torch.device("cuda", 0)))
    for step in range(2):
        trainer.train_step(step)
    metrics = {}
    syncs = count_syncs(lambda: metrics.update(trainer.train_step(2)))
    print(f"\nMoE ({capacity_factor=}): {len(syncs)} host syncs in one step:\n" + "\n".join(syncs))
    assert len(metrics["moe_load_max"]) == 2 and 1 <= len(syncs) <= METRIC_READS, "\n".join(syncs)
