"""Expert parallelism over NCCL: the all-to-all with uneven splits on GPUs, in the real Trainer.

A tiny MoE (4 experts, top-2, a shared expert, aux and z-losses) trains 4 steps at dp 2 = ep 2 on two GPUs, each
holding 2 experts, the tokens crossing by NCCL's all_to_all_single; one GPU runs the same micro-batches with every
expert local. fp32 with TF32 off: NCCL's reduction order is the only difference, so losses are held at 1e-5
relative and parameters at 1e-4, as tests/gpu/test_multi_gpu.py holds the other layouts.
"""

import pytest
import torch
import torch.distributed as dist
from nccl_harness import run_on_gpus
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

pytestmark = pytest.mark.cuda_multi

MOE = {"preset": "llama-tiny", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2, "d_ff": 48,
       "vocab_size": 300, "n_experts": 4, "moe_top_k": 2, "moe_d_ff": 16, "moe_shared_experts": 1,
       "moe_shared_d_ff": 8, "moe_aux_loss_coef": 0.05, "moe_z_loss_coef": 0.01, "dropout": 0.0,
       "attn_dropout": 0.0}


def _train(parallel: dict, grad_accum: int, stage: int) -> dict:
    res = tiny_resolved(model=MOE, parallel=parallel, zero={"stage": stage},
                        train={"steps": 4, "micro_batch": 2, "grad_accum": grad_accum, "eval_batches": 1,
                               "precision": "fp32", "tf32": False})
    topo = Topology.of(res.recipe.parallel) if dist.is_initialized() else Topology.solo(torch.device("cuda", 0))
    trainer = Trainer(res, topo)
    result = trainer.fit()
    return {"losses": result.losses, "params": trainer.full_state_dict(), "device": str(topo.device),
            "backend": dist.get_backend() if dist.is_initialized() else None, "ep_rank": topo.ep_rank}


@pytest.mark.parametrize("stage", [1, 3])
def test_ep2_on_two_gpus_equals_one_gpu(stage):
    ref = _train({}, 4, stage)
    results = run_on_gpus(_train, 2, {"dp": 2, "ep": 2}, 2, stage, timeout_s=300.0)
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"] and results[0]["backend"] == "nccl"
    assert [r["ep_rank"] for r in results] == [0, 1]
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        for name, value in ref["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-4, msg=name)
