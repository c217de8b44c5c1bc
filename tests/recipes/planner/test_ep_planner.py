"""The planner under expert parallelism: per-rank model states are the dense parameters' over dp x cp plus this
rank's experts (1/ep of them) over the expert-data-parallel group, byte for byte what the two halves of
parallel/expert/zero.py's optimizer hold after training steps (stages 0-3 at dp 4 = ep 2 x edp 2)."""

from __future__ import annotations

from harness import run_distributed
from recipe_helpers import tiny_resolved

from megazoo.models.layout import EXPERT_PARAMETERS
from megazoo.parallel.topology import Topology
from megazoo.recipes.planner.fit import Layout, device_memory, expert_split_states, recipe_layout
from megazoo.recipes.planner.zero import megazoo_state_memory
from megazoo.recipes.training.trainer import Trainer

MOE = {"preset": "llama-tiny", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
       "vocab_size": 300, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": 16, "dropout": 0.0, "attn_dropout": 0.0}


def _psi(half) -> int:
    buckets = getattr(half, "buckets", None)  # stages 1-3: padded to a multiple of the group each
    return sum(b.flat_params.numel() for b in buckets) if buckets else sum(p.numel() for p in half.params)


def _measure(dp: int):
    out = {}
    for stage in range(4):
        res = tiny_resolved(model=MOE, parallel={"dp": dp, "ep": 2}, zero={"stage": stage},
                            train={"micro_batch": 1, "grad_accum": 2, "steps": 1, "eval_batches": 1})
        trainer = Trainer(res, Topology.of(res.recipe.parallel))
        trainer.fit()
        zero = trainer.zero
        local = {n: p.numel() for n, p in trainer.model.named_parameters()}
        experts = sum(n for name, n in local.items() if name.endswith(EXPERT_PARAMETERS))
        out[stage] = {"dense": (zero.dense.memory_bytes(), _psi(zero.dense)),
                      "experts": (zero.experts.memory_bytes(), _psi(zero.experts)), "total": zero.memory_bytes(),
                      "local": sum(local.values()), "local_experts": experts}
    return out


def test_planner_equals_measured_expert_split():
    dp, edp = 4, 2
    for rank in run_distributed(_measure, dp, dp):
        for stage, got in rank.items():
            for half, group in (("dense", dp), ("experts", edp)):
                memory, psi = got[half]
                plan = megazoo_state_memory(psi, group, stage, "fp64")
                assert memory == {"params": plan.params_bytes, "grads": plan.grads_bytes,
                                  "optimizer": plan.optimizer_bytes}, (dp, stage, half)
            res = tiny_resolved(model=MOE, parallel={"dp": dp, "ep": 2}, zero={"stage": stage},
                                train={"micro_batch": 1, "grad_accum": 2, "precision": "fp64"})
            mem = device_memory(res.model, recipe_layout(res), 80)
            assert mem.psi == got["local"]  # this rank's parameters: the dense ones and half of the experts
            planned = expert_split_states(got["local"] - got["local_experts"], got["local_experts"],
                                          recipe_layout(res))
            assert mem.states == planned
            # Unpadded plan vs padded buckets: within the padding (< one group of elements per bucket).
            assert abs(planned.total_bytes - sum(got["total"].values())) <= 0.01 * planned.total_bytes


def test_ep_shrinks_per_rank_states():
    cfg = tiny_resolved(model={**MOE, "n_layer": 4}).model
    one, two = (device_memory(cfg, Layout(dp=4, zero=1, precision="fp32", ep=ep), 80) for ep in (1, 2))
    assert two.psi < one.psi and two.model_states < one.model_states
    assert "experts over ep=2" in two.layout.describe()


def test_search_tries_ep_and_costs_its_all_to_alls():
    """`plan --search` lays an MoE model out at every ep dividing dp and the experts (flat ZeRO only, as resolve
    demands); each ep > 1 candidate's all-to-all term is the formula's bytes over the link its ep ranks use."""
    from megazoo.models.presets import presets
    from megazoo.parallel.expert import all_to_all_bytes
    from megazoo.recipes.gpus import GPUS
    from dataclasses import replace

    from megazoo.recipes.planner.cost_model import CostModel, search, step_time

    cfg = presets()["mixtral-8x7b"]
    cm = CostModel.for_gpu(GPUS["a100-80gb"])
    found = search(cfg, 64, 80, cm, global_batch=64, seq_len=4096, max_pp=4, zero_stages=(1,))
    eps = {c.layout.ep for c in found}
    assert max(eps) > 1 and eps <= {1, 2, 4, 8}, eps
    best = found[0].layout  # Mixtral 8x7B at ZeRO-1 on 64 A100s fits only with its experts split
    assert best.ep > 1 and not device_memory(cfg, replace(best, ep=1), 80).fits
    for c in found:
        lay = c.layout
        assert lay.dp % lay.ep == 0 and cfg.n_experts % lay.ep == 0
        assert lay.ep == 1 or lay.sharding == "flat"
        if lay.ep > 1:
            layers = -(-cfg.n_layer // lay.pp)
            bw = cm.intra_node_bw if lay.tp * lay.ep <= cm.per_node else cm.inter_node_bw
            per_layer = all_to_all_bytes(lay.seq_len * lay.micro_batch, 2, cfg.d_model, lay.ep, 2,
                                         6 if lay.checkpointing else 4)
            assert c.time.ep_comm == layers * lay.grad_accum * per_layer / bw
        else:
            assert c.time.ep_comm == 0
        assert c.time == step_time(cfg, lay, c.memory.psi, cm)
