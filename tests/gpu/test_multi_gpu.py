"""Multi-GPU (NCCL) parity: every layout trains the same function as one GPU, as the CPU suite checks with gloo.

Ranks are spawned by tests/gpu/nccl_harness.py (rank r on GPU r); the single-GPU reference runs in this process
on GPU 0. Recipes run in fp32 with train.tf32 = false (the recipe default turns TF32 on), so NCCL's reduction order is the only
difference: losses are held at 1e-5 relative and parameters at 1e-4, as the CPU suite holds fp32 layouts.
The pipeline cases move >= 16 MiB activations per micro-batch between the stages (where NCCL's p2p blocks a
large send until its receive is posted, and a mis-ordered schedule deadlocks) under a collective timeout, so a
hang fails the test, naming the rank, instead of hanging the suite.
"""

import pytest
import torch
import torch.distributed as dist
from nccl_harness import run_on_gpus
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

pytestmark = pytest.mark.cuda_multi

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-4
TIMEOUT_S = 300.0
needs_4_gpus = pytest.mark.skipif(torch.cuda.device_count() < 4,
                                  reason=f"needs >= 4 GPUs: {torch.cuda.device_count()} visible")

# Pipeline recipe: one micro-batch's activations are 32 x 256 tokens x 1024 features x 4 bytes = 32 MiB.
PIPE_MODEL = {"n_layer": 4, "d_model": 1024, "n_head": 8}
PIPE_TRAIN = {"steps": 4, "warmup_steps": 1, "micro_batch": 32, "grad_accum": 4, "seq_len": 256,
              "precision": "fp32", "tf32": False}
PIPE_DATA = {"synthetic_tokens": 200_000}  # > 4 global batches of 128 x 257 tokens
ACTIVATION_BYTES = 32 * 256 * 1024 * 4


def _sections(**sections) -> dict:
    base = {"train": {"precision": "fp32", "tf32": False}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


def _train(sections: dict, with_params: bool = True) -> dict:
    """Train the recipe on this rank's GPU (the harness initialised NCCL); picklable results."""
    res = tiny_resolved(**sections)
    par = res.recipe.parallel
    topo = Topology.build(par.dp, par.tp, par.pp) if dist.is_initialized() else Topology.solo(torch.device("cuda", 0))
    trainer = Trainer(res, topo)
    result = trainer.fit()
    return {"losses": result.losses, "norms": result.grad_norms, "device": str(topo.device),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "params": trainer.full_state_dict() if with_params else {}}


def _reference(**sections) -> dict:
    return _train(_sections(**sections))


def assert_same(got: dict, ref: dict, what: str, params: bool = True):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    assert len(got["losses"]) == len(ref["losses"]) and got["losses"][-1] < got["losses"][0], what
    if params:
        assert got["params"].keys() == ref["params"].keys()
        for name, value in ref["params"].items():
            torch.testing.assert_close(got["params"][name].cpu(), value.cpu(), rtol=0, atol=PARAM_ATOL,
                                       msg=lambda m: f"{what} {name}: {m}")


def _check_ranks(results: list[dict], world: int):
    assert [r["device"] for r in results] == [f"cuda:{i}" for i in range(world)]  # one GPU per rank
    assert {r["backend"] for r in results} == {"nccl"}


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_pp2_schedules_with_large_activations(schedule, virtual):
    assert ACTIVATION_BYTES >= 16 << 20
    ref = _train(_sections(model=PIPE_MODEL, train=PIPE_TRAIN, data=PIPE_DATA), with_params=False)
    sections = _sections(model=PIPE_MODEL, train=PIPE_TRAIN, data=PIPE_DATA,
                         parallel={"pp": 2, "schedule": schedule, "virtual_stages": virtual, "timeout_s": TIMEOUT_S})
    results = run_on_gpus(_train, 2, sections, False, timeout_s=TIMEOUT_S)
    _check_ranks(results, 2)
    for rank, got in enumerate(results):
        # fp32 micro-batches of 32 MiB summed in a different order: 1e-4 covers it, a wrong schedule does not.
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0,
                                   msg=lambda m: f"pp2 {schedule} rank {rank}: {m}")


@pytest.fixture(scope="module")
def one_gpu_reference():
    return _reference(train={"micro_batch": 8})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dp2_zero_equals_one_gpu(one_gpu_reference, stage):
    sections = _sections(parallel={"dp": 2}, train={"micro_batch": 4}, zero={"stage": stage})
    results = run_on_gpus(_train, 2, sections, timeout_s=TIMEOUT_S)
    _check_ranks(results, 2)
    for rank, got in enumerate(results):
        assert_same(got, one_gpu_reference, f"dp2 ZeRO-{stage} rank {rank}")


def test_tp2_equals_one_gpu(one_gpu_reference):
    results = run_on_gpus(_train, 2, _sections(parallel={"tp": 2}, train={"micro_batch": 8}), timeout_s=TIMEOUT_S)
    _check_ranks(results, 2)
    for rank, got in enumerate(results):
        assert_same(got, one_gpu_reference, f"tp2 rank {rank}")


@needs_4_gpus
@pytest.mark.parametrize("stage", [1, 2])
def test_dp2_pp2_with_cpu_offload_equals_one_gpu(stage):
    ref = _reference(train={"micro_batch": 8}, model={"n_layer": 4})
    sections = _sections(parallel={"dp": 2, "pp": 2, "schedule": "1f1b"}, model={"n_layer": 4},
                         train={"micro_batch": 2, "grad_accum": 2}, zero={"stage": stage, "offload": "cpu"})
    results = run_on_gpus(_train, 4, sections, timeout_s=TIMEOUT_S)
    _check_ranks(results, 4)
    for rank, got in enumerate(results):
        assert_same(got, ref, f"dp2 x pp2 ZeRO-{stage} offload rank {rank}")
