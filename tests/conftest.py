import os
from pathlib import Path

# The CPU suite and the GPU suite (tests/gpu, `make test-gpu`) share this file; MEGAZOO_TEST_GPU=1 selects the GPU.
GPU_SUITE = os.environ.get("MEGAZOO_TEST_GPU") == "1"

if not GPU_SUITE:
    # `make test` must pass unchanged on a machine that HAS a GPU: the training entry point picks GPU LOCAL_RANK
    # whenever CUDA exists (parallel/topology.py local_device), so `megazoo train` subprocesses and Topologies
    # built here would move to CUDA/NCCL. Hiding every GPU keeps the CPU suite on the CPU (gloo). It must be set
    # before torch initialises CUDA (the driver reads CUDA_VISIBLE_DEVICES once, at the first CUDA call, and
    # torch caches the device count), i.e. before any test module runs torch code; subprocesses and forked or
    # spawned ranks inherit it.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Triton fixes compiled-or-interpreted when a kernel is defined (at import of kernels/), so the interpreter
    # (the only way Triton runs on CPU tensors) must be chosen before any test module imports the model. The GPU
    # suite runs compiled Triton, so it never sets this (and `make test-gpu` sets TRITON_INTERPRET=0).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption("--data-dir", default=None,
                     help="folder with the shared evaluation data (default: $MEGAZOO_DATA_DIR or ../shared/data)")


@pytest.fixture(scope="session")
def data_dir(request) -> Path:
    """The shared data folder. A missing folder fails the test: it is never a skip."""
    path = Path(request.config.getoption("--data-dir") or os.environ.get("MEGAZOO_DATA_DIR")
                or REPO.parent / "shared" / "data")
    assert path.is_dir(), f"data directory {path} not found: pass --data-dir or set MEGAZOO_DATA_DIR"
    return path


def pytest_collection_modifyitems(config, items):
    """Skip `cuda` tests without a visible GPU and `cuda_multi` tests with fewer than two, saying why."""
    hidden = "" if GPU_SUITE else " (the CPU suite hides GPUs with CUDA_VISIBLE_DEVICES=''; run `make test-gpu`)"
    no_cuda = None if torch.cuda.is_available() else f"needs CUDA: torch.cuda.is_available() is False{hidden}"
    count = torch.cuda.device_count() if no_cuda is None else 0
    few = None if count >= 2 else f"needs >= 2 GPUs: {count} visible{hidden}"
    for item in items:
        if no_cuda and item.get_closest_marker("cuda"):
            item.add_marker(pytest.mark.skip(reason=no_cuda))
        if few and item.get_closest_marker("cuda_multi"):
            item.add_marker(pytest.mark.skip(reason=few))
