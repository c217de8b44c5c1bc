import os
from pathlib import Path

# Triton fixes compiled-or-interpreted when a kernel is defined (at import of kernels/), so the interpreter
# (the only way Triton runs on CPU tensors) must be chosen before any test module imports the model.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

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
