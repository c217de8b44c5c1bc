"""ZeRO-Offload's host memory: masters and owned gradients pinned on exactly their own bytes (torch's pinned
allocator rounds each block up to a power of two), and falling back to torch's pinning when registration is
refused. CUDA's runtime is faked, so this runs on CPU; tests/gpu runs offload for real."""

from __future__ import annotations

import gc

import torch

from megazoo.parallel.zero import partitioned
from megazoo.parallel.zero.partitioned import host_tensor


class FakeCudart:
    def __init__(self, status: int = 0):
        self.status, self.registered, self.unregistered = status, [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
        self.registered.append((ptr, size, flags))
        return self.status

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_pinned_host_tensors_register_exactly_their_bytes(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    t = host_tensor((1000, 3), torch.float32, pin=True)  # 12,000 bytes: a power-of-two allocator takes 16,384
    assert t.shape == (1000, 3) and t.device.type == "cpu"
    assert fake.registered == [(t.data_ptr(), 12_000, 0)]
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert fake.unregistered == [ptr]  # unpinned when freed


def test_refused_registration_falls_back_to_torch_pinning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(status=1))
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self)
    host_tensor((5,), torch.float32, pin=True)
    assert pinned == [torch.Size([5])]


def test_unpinned_host_tensors_touch_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: (_ for _ in ()).throw(AssertionError("CUDA touched")))
    assert host_tensor((4,), torch.float64, pin=False).dtype == torch.float64
    assert partitioned.host_tensor((0,), torch.float32, pin=True).numel() == 0
