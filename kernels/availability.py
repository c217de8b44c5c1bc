"""What an implementation needs to run here, and what to tell the user when it is missing.

Every check returns None when the implementation can run on `device`, or a sentence saying why not (and how to
fix it). Nothing here imports apex or Triton eagerly: looking them up must stay cheap and must not fail on a
machine that has neither.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

# apex is not on PyPI (`pip install apex` installs an unrelated package): it is built from source against the
# installed torch and CUDA toolkit, with its C++/CUDA extensions.
APEX_INSTALL = ("apex is not on PyPI (`pip install apex` installs an unrelated package); build NVIDIA apex from "
                "source on a CUDA machine with the CUDA toolkit matching torch:\n"
                "    git clone https://github.com/NVIDIA/apex && cd apex\n"
                "    pip install -v --disable-pip-version-check --no-cache-dir --no-build-isolation "
                "--config-settings \"--build-option=--cpp_ext\" --config-settings \"--build-option=--cuda_ext\" ./")
TRITON_INSTALL = "pip install 'megazoo[kernels]' (or: pip install 'triton>=3.7')"


@dataclass(frozen=True)
class Candidate:
    """One implementation of one op, before it is chosen.

    `load` imports lazily and returns the op's function (so apex / Triton are imported only when picked);
    `missing(device)` is None when it can run on `device`, else the reason; `detail` says what runs, for the log.
    `dtypes`: the tensor dtypes it takes (None: any). `by_prefer`: whether `[kernels] prefer` may pick it; False
    for an implementation that is worse than the default in a way a family preference should never buy (an
    attention that materialises the s x s scores instead of SDPA's fused kernel): only a per-op override does.
    """

    name: str
    load: Callable[[], Callable]
    detail: str
    missing: Callable[[torch.device], str | None] = lambda device: None
    dtypes: tuple[torch.dtype, ...] | None = None
    by_prefer: bool = True

    def unavailable(self, device: torch.device, dtype: torch.dtype | None) -> str | None:
        """Why it cannot run on `device` for tensors of `dtype` (None: it can)."""
        reason = self.missing(device)
        if reason is None and dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reason = f"it takes {names} tensors, not {str(dtype).removeprefix('torch.')}"
        return reason


HALF_AND_FLOAT = (torch.float32, torch.bfloat16, torch.float16)  # what our Triton and apex kernels are built for


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def apex_missing(*extensions: str) -> Callable[[torch.device], str | None]:
    """apex runs when it is installed *with* the compiled CUDA extensions the op uses, on a CUDA device."""

    def check(device: torch.device) -> str | None:
        if not module_exists("apex"):
            return f"apex is not installed. {APEX_INSTALL}"
        absent = [ext for ext in extensions if not module_exists(ext)]
        if absent:
            return (f"apex is installed without its compiled extension(s) {', '.join(absent)} (a Python-only "
                    f"build). Rebuild it with --cpp_ext and --cuda_ext: {APEX_INSTALL}")
        if device.type != "cuda":
            return f"apex kernels run on CUDA devices only (this device is {device.type})"
        return None

    return check


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        importlib.import_module("triton")
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything else
        return f"Triton is not importable ({type(exc).__name__}: {exc}). Install it: {TRITON_INSTALL}"
    return None


def triton_interpreted() -> bool:
    """Whether our Triton kernels were defined in interpreter mode (TRITON_INTERPRET=1 when they were imported).

    Triton decides at `@triton.jit` time, so we ask the kernel module, not the environment."""
    from megazoo.kernels import triton_common
    return triton_common.INTERPRETED


def triton_missing(device: torch.device) -> str | None:
    """Triton compiles for CUDA; on CPU it runs only through its interpreter (slow: meant for tests)."""
    error = _triton_import_error()
    if error:
        return error
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreted():
        return None
    return (f"Triton compiles kernels for CUDA only; on {device.type} it runs only through its interpreter "
            f"(start Python with TRITON_INTERPRET=1 in the environment: slow, meant for tests)")
