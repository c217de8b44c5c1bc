"""Everything megazoo asks of the accelerator runtime, in one place: library code calls these, never torch.cuda.

    availability   cuda_available, cuda_device_count, set_device, current_device
    events         timing_event (pipeline busy time), copy_event (ZeRO-Offload's device-to-host copies), synchronize
    RNG state      rng_state, set_rng_state, manual_seed, fork_rng
    memory stats   max_memory_reserved, reset_peak_memory_stats
    pinning        pin_in_place (cudaHostRegister on a tensor's own bytes), pinned_empty (staging buffers)
    properties     device_name, device_capability, multi_processor_count

Each function takes the device it is about and does the CPU's thing for a CPU device (the host clock's events are
None, the CPU generator's state, no memory statistics: None), so callers need no `if device.type == "cuda"`.

CUDA calls go through one `CudaRuntime` object. The real one (`TorchCuda`) calls torch.cuda when asked, never at
import. The dry run on fake CUDA (parallel/simulation/fake_cuda.py) swaps in its stub with `using_runtime(stub)`: fake
tensors carry a CUDA device but there is no driver to ask, so each call is answered by the stub and recorded as
"not executed" - which is why no library file may call torch.cuda itself: the stubs would not be complete.
Host reads the step needs (an event's elapsed time, the memory peak) are made after the step, in one place each.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch


class CudaRuntime:
    """The CUDA calls megazoo makes. `TorchCuda` runs them; parallel/simulation/fake_cuda.StubCuda answers them without a
    driver. A method per call, so a stub that misses one fails loudly instead of reaching torch.cuda."""

    def available(self) -> bool: raise NotImplementedError
    def device_count(self) -> int: raise NotImplementedError
    def set_device(self, device: torch.device) -> None: raise NotImplementedError
    def current_index(self) -> int: raise NotImplementedError
    def synchronize(self, device: torch.device) -> None: raise NotImplementedError
    def event(self, timing: bool): raise NotImplementedError
    def get_rng_state(self, device: torch.device) -> torch.Tensor: raise NotImplementedError
    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None: raise NotImplementedError
    def manual_seed(self, seed: int, device: torch.device) -> None: raise NotImplementedError
    def fork_rng(self, device: torch.device): raise NotImplementedError
    def max_memory_reserved(self, device: torch.device) -> int: raise NotImplementedError
    def reset_peak_memory_stats(self, device: torch.device) -> None: raise NotImplementedError
    def host_register(self, tensor: torch.Tensor) -> bool: raise NotImplementedError
    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor: raise NotImplementedError
    def device_name(self, device: torch.device) -> str: raise NotImplementedError
    def device_capability(self, device: torch.device) -> tuple[int, int]: raise NotImplementedError
    def multi_processor_count(self, device: torch.device) -> int: raise NotImplementedError


class TorchCuda(CudaRuntime):
    """The real CUDA runtime, through torch.cuda (looked up at each call, so tests may monkeypatch torch.cuda)."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def current_index(self) -> int:
        return torch.cuda.current_device()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def event(self, timing: bool):
        return torch.cuda.Event(enable_timing=timing)

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        torch.cuda.set_rng_state(state, device)

    def manual_seed(self, seed: int, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)

    def fork_rng(self, device: torch.device):
        return torch.random.fork_rng(devices=[device], device_type="cuda")

    def max_memory_reserved(self, device: torch.device) -> int:
        return torch.cuda.max_memory_reserved(device)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def host_register(self, tensor: torch.Tensor) -> bool:
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)) != 0:
            return False
        weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())  # unpin when it is freed
        return True

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def device_name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device)

    def device_capability(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def multi_processor_count(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count


_runtime: list[CudaRuntime] = [TorchCuda()]  # the last entry answers; using_runtime pushes and pops


def runtime() -> CudaRuntime:
    return _runtime[-1]


@contextlib.contextmanager
def using_runtime(stub: CudaRuntime) -> Iterator[CudaRuntime]:
    """CUDA calls inside go to `stub` (the fake-CUDA dry run's); the real runtime again after."""
    _runtime.append(stub)
    try:
        yield stub
    finally:
        _runtime.remove(stub)


def _cuda(device) -> bool:
    return torch.device(device).type == "cuda"


# ---- availability


def cuda_available() -> bool:
    return runtime().available()


def cuda_device_count() -> int:
    return runtime().device_count() if runtime().available() else 0


def set_device(device: torch.device) -> None:
    """Make `device` this process's current GPU (before NCCL binds to it); nothing for the CPU."""
    if _cuda(device):
        runtime().set_device(torch.device(device))


def current_device() -> torch.device:
    """The current GPU (the one set_device chose)."""
    return torch.device("cuda", runtime().current_index())


# ---- events


def synchronize(device: torch.device) -> None:
    """Wait for everything queued on `device` (nothing is queued on the CPU)."""
    if _cuda(device):
        runtime().synchronize(torch.device(device))


def timing_event(device: torch.device):
    """A recorded CUDA timing event on a GPU (read its elapsed_time after the step), None on the CPU, where the
    host clock times the work itself."""
    if not _cuda(device):
        return None
    event = runtime().event(timing=True)
    event.record()
    return event


def copy_event(device: torch.device):
    """A recorded event after the copies queued so far on `device` (query() / synchronize() when they landed)."""
    event = runtime().event(timing=False)
    event.record()
    return event


# ---- random number generator state


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator a random op on `device` draws from."""
    return runtime().get_rng_state(torch.device(device)) if _cuda(device) else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if _cuda(device):
        runtime().set_rng_state(state, torch.device(device))
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int, device: torch.device) -> None:
    """Seed `device`'s generator only (the CPU's for a CPU device)."""
    if _cuda(device):
        runtime().manual_seed(seed, torch.device(device))
    else:
        torch.manual_seed(seed)


def fork_rng(device: torch.device):
    """Inside: draw freely; after: the CPU generator and `device`'s back where they were."""
    if _cuda(device):
        return runtime().fork_rng(torch.device(device))
    return torch.random.fork_rng(devices=[])


# ---- memory statistics


def max_memory_reserved(device: torch.device) -> int | None:
    """The caching allocator's peak reservation since the last reset; None for the CPU (no allocator stats)."""
    return runtime().max_memory_reserved(torch.device(device)) if _cuda(device) else None


def reset_peak_memory_stats(device: torch.device) -> None:
    if _cuda(device):
        runtime().reset_peak_memory_stats(torch.device(device))


# ---- pinned host memory


def pin_in_place(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` page-locked (host <-> GPU copies become asynchronous DMA): registered with cudaHostRegister on
    exactly its own bytes - torch's pinned allocator rounds every block up to a power of two, up to 2x the host
    memory ZeRO-Offload's masters and moments need - or, where registration is refused (a locked-memory limit), a
    copy from torch's pinned allocator."""
    if tensor.numel() == 0 or runtime().host_register(tensor):
        return tensor
    return tensor.pin_memory()


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked host tensor (a staging buffer for a non-blocking device-to-host copy)."""
    return runtime().pinned_empty(shape, dtype)


# ---- device properties


def device_name(device: torch.device) -> str | None:
    """The GPU's name ("NVIDIA H100 80GB HBM3"), None for the CPU."""
    return runtime().device_name(torch.device(device)) if _cuda(device) else None


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability (major, minor), None for the CPU (FP8 needs 8.9+: parallel/tensor/fp8.py)."""
    return runtime().device_capability(torch.device(device)) if _cuda(device) else None


def multi_processor_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of the GPU, None for the CPU."""
    return runtime().multi_processor_count(torch.device(device)) if _cuda(device) else None
