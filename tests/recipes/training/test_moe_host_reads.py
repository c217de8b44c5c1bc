"""The MoE step's host reads, counted so they cannot grow (DESIGN principle 10: no host read in the step but the
metrics'). tests/host_reads.py counts every `.tolist()` / `.item()` and every op that sizes its output by values
(nonzero, boolean masks, repeat_interleave without output_size) on CPU, with where it happened.

Budget of one `Trainer.train_step` (2 MoE layers, 2 micro-batches, fp32 grouped matmul):
  * recipes/training/trainer.py `_host_values`: the one packed read of loss, norm, stop and the MoE figures;
  * at ep > 1, dropless: parallel/expert/dispatch.py `exchange_rows`: one read of the split sizes per MoE layer
    forward (the uneven all-to-all needs them on the host, as torchtitan's and Megatron's dispatchers do);
  * at ep > 1 with a capacity factor: none (padded slots: static splits), and none at ep 1.
The optimizer is torch's fused AdamW (kernels.adamw = "torch"), as on a GPU: kernels/optimizer.py's ReferenceAdamW
reads its step counter, a host tensor, every parameter.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from harness import run_distributed
from host_reads import counting_host_reads
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

MOE = {"preset": "llama-tiny", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
       "vocab_size": 300, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": 16, "moe_aux_loss_coef": 0.01,
       "moe_z_loss_coef": 0.01, "dropout": 0.0, "attn_dropout": 0.0}


def test_the_counter_sees_each_kind_of_read():
    x = torch.arange(4)
    with counting_host_reads() as reads:
        x.sum().item()
        x.tolist()
        x[x > 1]
        torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, x, output_size=6)  # sized by the caller: no read
        x.nonzero()
    assert len(reads) == 5, reads


def _reads(parallel: dict, model: dict) -> list[Counter]:
    res = tiny_resolved(model={**MOE, **model}, parallel=parallel,
                        train={"steps": 2, "micro_batch": 2, "grad_accum": 2, "precision": "fp32"},
                        kernels={"adamw": "torch"})  # torch's fused AdamW: its step counts stay on the device

    def work():
        trainer = Trainer(res, Topology.of(res.recipe.parallel))
        assert all(m.experts.fallback is None for chunk in trainer.chunks for m in chunk.modules()
                   if hasattr(m, "dispatcher"))  # the grouped matmul, not the per-expert loop's split
        trainer.train_step(0)
        with counting_host_reads() as reads:
            trainer.train_step(1)
        return Counter(r.split(" at ")[1].split(":")[0] for r in reads)

    return run_distributed(work, res.world_size) if res.world_size > 1 else [work()]


@pytest.mark.parametrize("parallel, model, per_layer_forward", [
    ({}, {}, 0),
    ({}, {"moe_capacity_factor": 1.0}, 0),
    ({"dp": 2, "ep": 2}, {}, 1),
    ({"dp": 2, "ep": 2}, {"moe_capacity_factor": 1.0}, 0),
], ids=["ep1", "ep1-capacity", "ep2", "ep2-capacity"])
def test_step_reads_the_host_within_budget(parallel, model, per_layer_forward):
    expected = Counter({"recipes/training/trainer.py": 1})
    if per_layer_forward:
        expected["parallel/expert/dispatch.py"] = per_layer_forward * 2 * 2  # layers x micro-batches
    for got in _reads(parallel, model):
        assert got == expected


def test_per_expert_loop_runs_on_fake_tensors():
    """The loop's split sizes are its one host read; the dry run's fake tensors hold no counts, so the rows split
    evenly (parallel/expert.host_row_counts), as the all-to-all's do there: forward and backward shapes hold (this
    was moe-demo's failure on fake CUDA: bf16 with moe_d_ff 172 takes the loop, whose fake counts read as 0)."""
    from megazoo.models.moe.experts import expert_ffn
    from megazoo.parallel.expert import host_row_counts
    from megazoo.parallel.simulation.fake_world import fake_tensors

    assert host_row_counts(torch.tensor([3, 0, 1]), 4) == [3, 0, 1]
    with fake_tensors():
        tokens = torch.empty(10, 8, requires_grad=True)
        w_fc, w_proj = torch.empty(4, 12, 8, requires_grad=True), torch.empty(4, 8, 6, requires_grad=True)
        counts = torch.zeros(4, dtype=torch.int64)
        assert host_row_counts(counts, 10) == [3, 3, 2, 2]
        out = expert_ffn(tokens, counts, w_fc, w_proj, impl="loop")
        out.sum().backward()
        assert out.shape == (10, 8) and w_fc.grad.shape == w_fc.shape
