"""The answers to every CUDA runtime call a step on fake CUDA makes, each recorded as "not executed".

A process with the fake CUDA shim (parallel/simulation/fake_cuda.py) has CUDA tensors but no driver. Inside `fake_cuda()`:
- megazoo's calls (parallel/accelerator.py, the only place library code reaches the runtime) go to `StubCuda`;
- torch's own Python-level questions get an answer: torch.cuda.is_available (torch.autocast asks it before it
  enables CUDA autocast) and torch.cuda.is_bf16_supported (asked for bf16). Set for the block, restored after.
Each call is counted under what it is (availability, events, RNG state, memory stats, host registration, device
properties), so the dry run's report can list exactly what a GPU would have executed and this run did not.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch

from megazoo.parallel.accelerator import CudaRuntime, using_runtime

# A device for the answers: H100 SXM's multiprocessor count; its name says what it is.
STUB_DEVICE_NAME = "fake CUDA device (no driver: megazoo fake_cuda)"
STUB_SMS = 132
STUB_CAPABILITY = (9, 0)  # H100's: FP8 tensor cores (train.fp8 checks for 8.9+ before the first step)
CUDA_RNG_STATE_BYTES = 16  # torch's CUDA (Philox) generator state: seed + offset, 8 bytes each

KINDS = {  # call -> (what kind of call, what the stub answered)
    "is_available": ("availability", "True"), "device_count": ("availability", "8"),
    "set_device": ("availability", "nothing set"), "current_index": ("availability", "the guard's device"),
    "synchronize": ("events", "returned at once"), "event": ("events", "an event that has always completed"),
    "get_rng_state": ("RNG state", "a 16-byte state of zeros"), "set_rng_state": ("RNG state", "ignored"),
    "manual_seed": ("RNG state", "ignored"), "fork_rng": ("RNG state", "the CPU generator only"),
    "max_memory_reserved": ("memory stats", "0"), "reset_peak_memory_stats": ("memory stats", "nothing reset"),
    "host_register": ("host registration", "registered (nothing pinned)"),
    "pinned_empty": ("host registration", "an unpinned host tensor"),
    "device_name": ("device properties", STUB_DEVICE_NAME), "multi_processor_count": ("device properties", "132"),
    "device_capability": ("device properties", "9.0 (an H100's)"),
    "torch.cuda.is_available": ("availability", "True (asked by torch.autocast)"),
    "torch.cuda.is_bf16_supported": ("device properties", "True (asked by torch.autocast for bf16)"),
    "sdpa backend choice": ("device properties", "FlashAttention for fp16/bf16, memory-efficient for fp32 (an "
                            "H100's choice); the math path with a mask or grouped heads"),
}


class StubEvent:
    """An event that has always completed: a fake step queues no work."""

    def __init__(self, stub: "StubCuda"):
        self._stub = stub

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "StubEvent") -> float:
        return 0.0


class StubCuda(CudaRuntime):
    """parallel/accelerator's CUDA runtime without a driver: every call answered and counted in `calls`."""

    def __init__(self):
        self.calls: Counter = Counter()

    def _note(self, name: str) -> None:
        self.calls[name] += 1

    def available(self) -> bool:
        self._note("is_available")
        return True

    def device_count(self) -> int:
        self._note("device_count")
        return 8

    def set_device(self, device: torch.device) -> None:
        self._note("set_device")

    def current_index(self) -> int:
        self._note("current_index")
        return 0

    def synchronize(self, device: torch.device) -> None:
        self._note("synchronize")

    def event(self, timing: bool) -> StubEvent:
        self._note("event")
        return StubEvent(self)

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        self._note("get_rng_state")
        return torch.zeros(CUDA_RNG_STATE_BYTES, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        self._note("set_rng_state")

    def manual_seed(self, seed: int, device: torch.device) -> None:
        self._note("manual_seed")

    def fork_rng(self, device: torch.device):
        self._note("fork_rng")
        return torch.random.fork_rng(devices=[])

    def max_memory_reserved(self, device: torch.device) -> int:
        self._note("max_memory_reserved")
        return 0

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self._note("reset_peak_memory_stats")

    def host_register(self, tensor: torch.Tensor) -> bool:
        self._note("host_register")
        return True

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        self._note("pinned_empty")
        return torch.empty(shape, dtype=dtype)

    def device_name(self, device: torch.device) -> str:
        self._note("device_name")
        return STUB_DEVICE_NAME

    def device_capability(self, device: torch.device) -> tuple[int, int]:
        self._note("device_capability")
        return STUB_CAPABILITY

    def multi_processor_count(self, device: torch.device) -> int:
        self._note("multi_processor_count")
        return STUB_SMS

    def not_executed(self) -> list[dict]:
        """What was answered instead of executed: [{"call", "kind", "count", "answer"}], by kind then call."""
        rows = [{"call": name, "kind": KINDS[name][0], "count": n, "answer": KINDS[name][1]}
                for name, n in self.calls.items()]
        return sorted(rows, key=lambda r: (r["kind"], r["call"]))


def _sdpa_as_a_gpu_picks(stub: StubCuda):
    """scaled_dot_product_attention on fake CUDA tensors, through the kernel a GPU's selector picks. A CPU build
    of torch has no CUDA backend selector, so SDPA on a CUDA tensor took the math path: fp32 scores and
    probabilities kept for backward, which FlashAttention never holds. Registered for AutogradCUDA (below
    autocast, which has cast q, k, v already); FlashAttention's and memory-efficient attention's fake kernels and
    autograd formulas are torch's own."""
    aten = torch.ops.aten

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        stub._note("sdpa backend choice")
        if attn_mask is not None or (enable_gqa and q.shape[-3] != k.shape[-3]):
            return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                           scale=scale, enable_gqa=enable_gqa)[0]
        if q.dtype in (torch.float16, torch.bfloat16):
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, grad, dropout_p, is_causal,
                                                            scale=scale)[0]

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", sdpa, "AutogradCUDA")
    for op in WHOLE_ON_A_GPU:
        lib.impl(op, _no_kernel(op), "CUDA")
    return lib


# aten ops with a CPU kernel and a CompositeImplicitAutograd one (all of them in torch 2.13), which a GPU build
# runs as its CUDA kernel: a CPU build has no CUDA kernel, so on fake CUDA the dispatcher ran the decomposition
# (silu_backward: sigmoid, 1 - sigmoid, two products, a sum; 5 temporaries of its input's size at once beside the
# kernel's one output, in every SwiGLU's backward: +1.2 GB at mixtral-8x7b-ft's experts). A CUDA registration makes
# the dispatcher send the op whole to fake tensors (their shape-only implementation); its body never runs.
WHOLE_ON_A_GPU = ("silu_backward", "mish_backward")


def _no_kernel(op: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"fake CUDA: aten.{op} has no CUDA kernel in this CPU build of torch; it runs on fake "
                           "tensors only")
    return kernel


@contextlib.contextmanager
def fake_cuda(stub: StubCuda | None = None) -> Iterator[StubCuda]:
    """Inside: megazoo's CUDA calls go to `stub`, torch's autocast finds CUDA available (bf16 included), SDPA
    runs the kernel a GPU would pick."""
    stub = stub or StubCuda()
    saved = torch.cuda.is_available, torch.cuda.is_bf16_supported

    def is_available() -> bool:
        stub._note("torch.cuda.is_available")
        return True

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        stub._note("torch.cuda.is_bf16_supported")
        return True

    torch.cuda.is_available, torch.cuda.is_bf16_supported = is_available, is_bf16_supported
    lib = _sdpa_as_a_gpu_picks(stub)
    try:
        with using_runtime(stub):
            yield stub
    finally:
        lib._destroy()  # the registration ends with the block
        torch.cuda.is_available, torch.cuda.is_bf16_supported = saved
