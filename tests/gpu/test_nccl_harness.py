"""The spawn harness itself (tests/gpu/nccl_harness.py). Unmarked: without CUDA its ranks fall back to the CPU
and gloo, so the CPU suite checks what it can (spawned ranks, results moved to the CPU, errors reported with the
rank's traceback); `make test-gpu` runs the same checks on NCCL through the `cuda_multi` case."""

import pytest
import torch
import torch.distributed as dist
from nccl_harness import run_on_gpus


def _sum_of_ranks():
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    return {"rank": rank, "backend": dist.get_backend(), "device": x.device.type, "x": x}


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return "ok"


def _check(results, backend: str):
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["backend"] == backend and r["device"] == ("cuda" if backend == "nccl" else "cpu")
        assert r["x"].device.type == "cpu"  # moved to the CPU before it was written
        torch.testing.assert_close(r["x"], torch.full((4,), 3.0))  # 1 + 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback runs where CUDA is not visible")
def test_spawned_ranks_fall_back_to_gloo_without_cuda():
    _check(run_on_gpus(_sum_of_ranks, 2, timeout_s=120), "gloo")
    with pytest.raises(RuntimeError, match=r"(?s)--- rank 1 ---.*rank 1 fails on purpose"):
        run_on_gpus(_fail_on_rank_1, 2, timeout_s=60)


@pytest.mark.cuda_multi
def test_spawned_ranks_run_nccl_one_gpu_each():
    _check(run_on_gpus(_sum_of_ranks, 2, timeout_s=120), "nccl")
