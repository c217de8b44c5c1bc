"""A CUDA device that is not there: the dry run's training step on fake CUDA tensors, with a CPU build of torch.

Fake tensors (parallel/simulation/fake_world.fake_tensors) already carry device "cuda" without storage. What a CPU build of
torch lacks is the runtime it asks about such a device; a small C++ shim supplies it (fake_cuda_shim.cpp: c10's
FakeGuardImpl as the CUDA device guard, and CUDA hooks that say CUDA exists). torch creates its CUDA hooks once,
during `import torch`, so the shim is loaded before torch, in a fresh interpreter:

    shim = build_shim()                      # in any process: g++ against the installed torch, cached
    # in a fresh interpreter, before anything imports torch:
    load_shim(shim)                          # dlopen it, import torch, self-test; FakeCudaUnavailable says why not

then parallel/simulation/fake_cuda_stubs.fake_cuda() answers the Python-level CUDA calls (megazoo's through
parallel/accelerator.py, torch's own autocast check) and lists each as "not executed".

This module imports no torch at import time (it runs before torch is loaded). The shim is pinned to the torch
release it was tested with (TESTED_TORCH): another release is refused with the reason, as is a CUDA build of torch
(which has a real CUDA runtime to clash with), a missing compiler, a failed build or load, or a failed self-test.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTED_TORCH = "2.13.0"  # the release the shim's headers and its self-test were checked against
SOURCE = Path(__file__).with_name("fake_cuda_shim.cpp")


class FakeCudaUnavailable(RuntimeError):
    """The fake CUDA device cannot be built or loaded here; the message says why and what would work."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "megazoo" / "fake_cuda"


def check_torch(version: str, cuda: str | None) -> None:
    """Refuse a torch the shim was not tested with, and a CUDA build (its real CUDA hooks would clash)."""
    if version.split("+")[0] != TESTED_TORCH:
        raise FakeCudaUnavailable(f"the fake CUDA shim is pinned to torch {TESTED_TORCH} (its headers and self-test "
                                  f"were checked there); this is torch {version}: install torch=={TESTED_TORCH} "
                                  "(CPU build) to dry-run on fake CUDA, or dry-run with --device cpu")
    if cuda is not None:
        raise FakeCudaUnavailable(f"torch {version} is a CUDA build (CUDA {cuda}): the fake CUDA device is for CPU "
                                  "builds; on a GPU machine run the step for real, or dry-run with --device cpu")


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise FakeCudaUnavailable("torch is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def build_shim(cache_dir: Path | None = None) -> Path:
    """The shim compiled against the installed torch (g++, ~5 s idle, 17-46 s on a loaded machine), cached in
    `cache_dir` (default ~/.cache/megazoo/fake_cuda) under a key of its source, the torch release, ABI and folder:
    built once per machine and key, whichever process asks first."""
    import torch

    check_torch(torch.__version__, torch.version.cuda)
    compiler = shutil.which("g++")
    if compiler is None:
        raise FakeCudaUnavailable("g++ is not on PATH: the fake CUDA shim is C++ built against torch's headers on "
                                  "first use; install g++ (Debian: apt-get install g++)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    source = SOURCE.read_bytes()
    root = _torch_dir()
    # The shim finds libc10.so through its RUNPATH, which names this torch's folder: a shim built for another
    # virtualenv (since deleted, or another checkout's) must not be reused, so the folder is part of the key.
    key = hashlib.sha256(source + f"{torch.__version__} {abi} {root.resolve()}".encode()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = cache / f"fake_cuda-{torch.__version__}-{key}.so"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    # One build per key on this machine: concurrent callers (pytest-xdist workers, two dry runs) wait for the
    # first one's g++ (tens of seconds on a loaded machine) instead of each compiling the same file.
    with open(cache / ".build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if out.is_file():
            return out
        return _compile(compiler, abi, root, out)


def _compile(compiler: str, abi: int, root: Path, out: Path) -> Path:
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-O1", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           "-I", str(root / "include"), str(SOURCE), "-L", str(root / "lib"), "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{root / 'lib'}", "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        errors = [line for line in done.stderr.splitlines() if "error" in line][:5] or done.stderr.splitlines()[-5:]
        raise FakeCudaUnavailable("building the fake CUDA shim failed (g++ exit {}):\n  {}".format(
            done.returncode, "\n  ".join(errors)))
    os.replace(tmp, out)  # atomic: a concurrent build never loads half a file
    return out


def load_shim(path: str | Path):
    """Load the shim, then torch, and check that torch sees the fake device (self_test). Must run before anything
    in this interpreter imports torch."""
    if "torch" in sys.modules:
        raise FakeCudaUnavailable("torch is already imported in this interpreter: the shim must be loaded before "
                                  "torch creates its CUDA hooks (run the fake-CUDA dry run in a fresh interpreter)")
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError as err:
        raise FakeCudaUnavailable(f"loading the fake CUDA shim {path} failed: {err}") from None
    import torch

    check_torch(torch.__version__, torch.version.cuda)
    if lib.megazoo_fake_cuda_hooks_active() != 1:
        raise FakeCudaUnavailable("torch created its CUDA hooks before the shim registered its own")
    self_test()
    return lib


def self_test() -> None:
    """A fake CUDA linear layer's forward and backward, with autocast, as the dry run's step does them: the
    device guard, the autograd engine's device queue and autocast's CUDA dispatch key all answer."""
    import torch

    from megazoo.parallel.simulation.fake_cuda_stubs import fake_cuda
    from megazoo.parallel.simulation.fake_world import fake_tensors

    try:
        with fake_cuda(), fake_tensors():
            layer = torch.nn.Linear(8, 8, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = layer(torch.randn(4, 8, device="cuda"))
            out.float().sum().backward()
            ok = (out.dtype == torch.bfloat16 and layer.weight.grad is not None
                  and layer.weight.grad.device.type == "cuda")
    except Exception as err:  # noqa: BLE001 - any failure is the refusal's reason
        raise FakeCudaUnavailable(f"the fake CUDA self-test failed: {type(err).__name__}: {err}") from None
    if not ok:
        raise FakeCudaUnavailable("the fake CUDA self-test failed: autocast or backward did not run on the fake "
                                  f"device (output {out.dtype} on {out.device})")
