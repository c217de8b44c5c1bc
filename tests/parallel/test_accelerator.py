"""parallel/accelerator.py: the one owner of CUDA runtime calls. On the CPU each helper does the CPU's thing; CUDA
calls reach whichever runtime is installed (a recording stub here, torch.cuda in a real job), and no library file
calls torch.cuda itself (so the fake-CUDA dry run's stubs are complete)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megazoo.parallel import accelerator
from megazoo.parallel.accelerator import CudaRuntime

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def test_cpu_rng_state_is_the_cpu_generators():
    torch.manual_seed(5)
    state = accelerator.rng_state(CPU)
    assert torch.equal(state, torch.get_rng_state())
    first = torch.rand(3)
    accelerator.set_rng_state(state, CPU)
    assert torch.equal(torch.rand(3), first)
    accelerator.manual_seed(5, CPU)
    assert torch.equal(torch.get_rng_state(), state)


def test_cpu_fork_rng_puts_the_generator_back():
    torch.manual_seed(1)
    before = torch.get_rng_state()
    with accelerator.fork_rng(CPU):
        torch.rand(10)
    assert torch.equal(torch.get_rng_state(), before)


def test_cpu_has_no_events_memory_stats_or_properties():
    assert accelerator.timing_event(CPU) is None
    assert accelerator.max_memory_reserved(CPU) is None
    assert accelerator.device_name(CPU) is None and accelerator.multi_processor_count(CPU) is None
    accelerator.synchronize(CPU)  # nothing queued, nothing to do
    accelerator.reset_peak_memory_stats(CPU)
    accelerator.set_device(CPU)


def test_without_cuda_the_count_is_zero(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: (_ for _ in ()).throw(AssertionError("asked")))
    assert accelerator.cuda_available() is False and accelerator.cuda_device_count() == 0


class Recording(CudaRuntime):
    """Answers every CUDA call and records it; a CPU device must never reach it."""

    def __init__(self):
        self.calls = []

    def __getattribute__(self, name):
        if name in CudaRuntime.__dict__ and not name.startswith("_"):
            calls = object.__getattribute__(self, "calls")
            return lambda *args, **kwargs: calls.append(name) or _ANSWERS.get(name)
        return object.__getattribute__(self, name)


class _Event:
    def record(self):
        pass


_ANSWERS = {"available": True, "device_count": 2, "current_index": 1, "event": _Event(),
            "get_rng_state": torch.zeros(16, dtype=torch.uint8), "max_memory_reserved": 123, "host_register": True,
            "device_name": "NVIDIA H100", "multi_processor_count": 132, "fork_rng": torch.random.fork_rng([])}


def test_cuda_calls_go_to_the_installed_runtime_and_cpu_calls_never_do():
    stub = Recording()
    with accelerator.using_runtime(stub):
        for dev in (CPU,):  # CPU: the stub sees nothing
            accelerator.rng_state(dev), accelerator.timing_event(dev), accelerator.max_memory_reserved(dev)
            accelerator.synchronize(dev), accelerator.manual_seed(0, dev), accelerator.device_name(dev)
        assert stub.calls == []
        assert accelerator.cuda_available() and accelerator.cuda_device_count() == 2
        assert accelerator.current_device() == torch.device("cuda", 1)
        assert accelerator.rng_state(CUDA).numel() == 16
        accelerator.set_rng_state(torch.zeros(16, dtype=torch.uint8), CUDA)
        accelerator.manual_seed(3, CUDA)
        assert accelerator.timing_event(CUDA) is _ANSWERS["event"]
        assert accelerator.max_memory_reserved(CUDA) == 123
        accelerator.reset_peak_memory_stats(CUDA)
        accelerator.synchronize(CUDA)
        accelerator.set_device(CUDA)
        assert accelerator.device_name(CUDA) == "NVIDIA H100" and accelerator.multi_processor_count(CUDA) == 132
        t = torch.empty(4)
        assert accelerator.pin_in_place(t) is t  # registered in place: the same tensor
    assert accelerator.runtime() is not stub  # the real runtime is back
    assert stub.calls == ["available", "available", "device_count", "current_index", "get_rng_state",
                          "set_rng_state", "manual_seed", "event", "max_memory_reserved", "reset_peak_memory_stats",
                          "synchronize", "set_device", "device_name", "multi_processor_count", "host_register"]


def test_refused_registration_pins_a_copy(monkeypatch):
    stub = Recording()
    _ANSWERS["host_register"] = False
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self)
    try:
        with accelerator.using_runtime(stub):
            accelerator.pin_in_place(torch.empty(5))
    finally:
        _ANSWERS["host_register"] = True
    assert pinned == [torch.Size([5])]


LIBRARY = ("data", "eval", "kernels", "models", "parallel", "recipes", "workers")
# The real runtime, and the fake-CUDA dry run's answers to torch's own questions (autocast asks torch.cuda).
OWNERS = {REPO / "parallel" / "accelerator.py", REPO / "parallel" / "simulation" / "fake_cuda_stubs.py"}


def _torch_cuda_uses(path: Path) -> list[int]:
    """Lines that reach torch.cuda.<something> (torch.backends.cuda's flags are settings, not runtime calls)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("package", LIBRARY)
def test_no_library_file_calls_torch_cuda_but_the_accelerator(package):
    wrong = [f"{p.relative_to(REPO)}:{line}" for p in sorted((REPO / package).rglob("*.py"))
             if p not in OWNERS for line in _torch_cuda_uses(p)]
    assert not wrong, "call megazoo.parallel.accelerator instead of torch.cuda:\n" + "\n".join(wrong)


def test_the_scan_sees_a_torch_cuda_call(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nx = torch.cuda.is_available()\ny = torch.backends.cuda.matmul\n")
    assert _torch_cuda_uses(src) == [2]
