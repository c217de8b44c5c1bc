"""Which device a process trains on: from the backend and LOCAL_RANK, never from "CUDA is available" alone.

CUDA is faked here (torch.cuda.is_available / device_count monkeypatched), so the GPU choices are checked on a
CPU machine; tests/gpu/ runs the same paths on a real GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

from megazoo.parallel import topology
from megazoo.parallel.topology import Topology, init_distributed, local_device


def fake_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_local_device_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device(0) == torch.device("cpu") and local_device(5) == torch.device("cpu")


def test_local_device_follows_local_rank_not_global_rank(monkeypatch):
    fake_cuda(monkeypatch, 4)
    assert local_device(0) == torch.device("cuda", 0)
    assert local_device(3) == torch.device("cuda", 3)
    with pytest.raises(ValueError, match=r"LOCAL_RANK = 4 but this node has 4 visible GPU"):
        local_device(4)


def test_nccl_init_selects_the_gpu_before_the_group_and_binds_it(monkeypatch):
    fake_cuda(monkeypatch, 8)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("set_device", dev)))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    init_distributed(11, 16, local_rank=3, init_method="env://", timeout_s=30)
    assert calls[0] == ("set_device", torch.device("cuda", 3))
    kind, kwargs = calls[1]
    assert kind == "init" and kwargs["backend"] == "nccl" and kwargs["device_id"] == torch.device("cuda", 3)
    assert kwargs["rank"] == 11 and kwargs["world_size"] == 16


def test_gloo_init_stays_on_cpu_even_with_cuda(monkeypatch):
    fake_cuda(monkeypatch, 8)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("set_device", dev)))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    init_distributed(0, 2, device="cpu", init_method="env://")
    assert calls == [("init", calls[0][1])] and calls[0][1]["backend"] == "gloo" and "device_id" not in calls[0][1]


def _build_with_fake_cuda():
    torch.cuda.is_available = lambda: True  # this forked rank only
    torch.cuda.device_count = lambda: 8
    return str(Topology.build(2).device)


def test_gloo_topology_uses_the_cpu_when_cuda_exists():
    assert run_distributed(_build_with_fake_cuda, 2) == ["cpu", "cpu"]


def test_one_process_training_takes_the_local_gpu(monkeypatch, tmp_path):
    """`megazoo train` with one process used to train on the CPU even on a GPU machine."""
    from megazoo.recipes import train
    from megazoo.recipes.training.trainer import TrainResult

    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[model]\npreset = "gpt2-tiny"\n[data]\nsource = "synthetic"\n[run]\ndir = "{tmp_path / "run"}"\n')
    asked, ran = [], []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(train, "local_device", lambda r: asked.append(r) or torch.device("cpu"))
    monkeypatch.setattr(train, "run", lambda res, topo, stop=None, group=None: ran.append(topo) or TrainResult())
    assert train.main([str(recipe)]) == 0
    assert asked == [3] and ran[0].device == torch.device("cpu") and ran[0].world_size == 1


def test_backend_device_reads_the_group_backend(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert topology.backend_device() == torch.device("cuda", 5)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert topology.backend_device() == torch.device("cpu")
