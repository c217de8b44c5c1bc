"""Count the places a function reads device values on the host (DESIGN principle 10: the step reads none but the
metrics'), on any device, CPU included, where torch's CUDA sync debug mode does not exist.

Counted: `Tensor.tolist` (not a dispatched op, so patched), and the dispatched ops that read values on the host or
size their output by them: aten._local_scalar_dense (`.item()`, `int(t)`, `bool(t)`), nonzero, masked_select,
unique, boolean-mask indexing, repeat_interleave without output_size. Each record names the op and the caller's
file:line (relative to the repository) inside megazoo, so a failing budget says where the new read is."""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default"}


REPO = str(Path(__file__).resolve().parents[1])
TESTS = str(Path(__file__).resolve().parent)


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2]
              if f.filename.startswith(REPO) and not f.filename.startswith(TESTS) and "/.venv/" not in f.filename]
    return f"{frames[-1].filename[len(REPO) + 1:]}:{frames[-1].lineno}" if frames else "?"


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in READING_OPS or (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None) \
                or (name.startswith("aten.index.Tensor") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))):
            self.reads.append(f"{name} at {_where()}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_host_reads():
    """with counting_host_reads() as reads: ... -> reads: list of 'op at file:line'."""
    mode, original = HostReads(), torch.Tensor.tolist

    def tolist(self):
        mode.reads.append(f"Tensor.tolist at {_where()}")
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        with mode:
            yield mode.reads
    finally:
        torch.Tensor.tolist = original
