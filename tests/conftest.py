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

# One CPU thread in the test process, as every rank has (workers/local.py): the single-process references the
# parity tests hold layouts to run here. With two threads the same fp64 step is not the same from one process to
# the next: the tiny GPT's first loss came out 5.72736266115564 instead of ...114972 in 1 of 16 fresh processes
# (and ...152364 in 2 of 19 pytest runs), and Adam turns such 1e-12 differences on near-zero gradients into
# parameter differences over 1e-10; with one thread, 24 of 24 agreed. Two test workers share two cores anyway.
torch.set_num_threads(1)

from megazoo.data.published.catalog import CATALOG, DATA_DIR_ENV, cache_folder  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


REQUIRE_DATA_ENV = "MEGAZOO_REQUIRE_DATA"  # "1" (set by .ci/run): no data is a failure, never a skip


def pytest_addoption(parser):
    parser.addoption("--data-dir", default=None,
                     help="folder with the evaluation data (wikitext103/, lambada/, gpt2_bpe/); default: the first of "
                          "$MEGAZOO_DATA_DIR, ../shared/data and the cache (`megazoo data fetch all`) that holds it")


def _missing(folder: Path) -> list[str]:
    return [name for name, item in CATALOG.items() if item.found_in(folder) is None]


@pytest.fixture(scope="session")
def data_dir(request) -> Path:
    """The evaluation data folder: --data-dir, else the first of $MEGAZOO_DATA_DIR, ../shared/data and the user
    cache folder (where `megazoo data fetch` stores) that holds every catalog item (data/published/catalog.py). A given
    --data-dir without them fails; none found skips the data tests with one line, or fails them when
    MEGAZOO_REQUIRE_DATA=1 (CI)."""
    explicit = request.config.getoption("--data-dir")
    if explicit:
        if missing := _missing(Path(explicit)):
            pytest.fail(f"--data-dir {explicit} lacks {', '.join(missing)}: `megazoo data fetch all --dir "
                        f"{explicit}`", pytrace=False)
        return Path(explicit)
    looked = [(f"${DATA_DIR_ENV}", Path(os.environ[DATA_DIR_ENV])) if os.environ.get(DATA_DIR_ENV) else None,
              ("../shared/data", REPO.parent / "shared" / "data"), ("the cache", cache_folder(os.environ))]
    for _, folder in filter(None, looked):
        if not _missing(folder):
            return folder
    message = (f"no evaluation data in {', '.join(f'{label} ({folder})' for label, folder in filter(None, looked))}:"
               f" run `megazoo data fetch all`, or pass --data-dir DIR")
    if os.environ.get(REQUIRE_DATA_ENV) == "1":
        pytest.fail(f"{message} ({REQUIRE_DATA_ENV}=1: missing data fails)", pytrace=False)
    pytest.skip(message)


def pytest_sessionstart(session):
    """`make test-gpu` (MEGAZOO_TEST_GPU=1) without a GPU: say so and exit 2, instead of passing with every test
    skipped."""
    if GPU_SUITE and not torch.cuda.is_available():
        pytest.exit(f"make test-gpu needs a CUDA GPU; this machine has none (torch {torch.__version__}, CUDA build: "
                    f"{torch.version.cuda or 'no'}). On a GPU machine install the CUDA torch wheel first (README "
                    "\"On a GPU machine\"); the CPU suite is `make test`.", returncode=2)


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
