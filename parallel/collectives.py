"""Thin, version-tolerant names for the flat collectives (torch 2.13 renamed the *_into_tensor forms), and
the ledger that counts what they move.

Both take/produce tensors concatenated along dim 0: all_gather_flat(out[size * n, ...], x[n, ...]).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommLedger:
    """Elements and bytes this rank sends per collective kind, as ring algorithms move them: an all-gather
    producing n elements or a reduce-scatter consuming n sends n (N-1)/N; an all-reduce of n sends 2n (N-1)/N.
    (The ZeRO paper's communication volume, measured rather than derived.)"""

    elements: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, numel: int, element_size: int, group_size: int) -> None:
        factor = (2.0 if kind == "all_reduce" else 1.0) * (group_size - 1) / group_size
        self.elements[kind] += numel * factor
        self.bytes[kind] += numel * factor * element_size
        self.calls[kind] += 1

    def reset(self) -> None:
        self.elements.clear()
        self.bytes.clear()
        self.calls.clear()

    def summary(self) -> dict[str, float]:
        """{'<kind>_bytes': ..., 'total_bytes': ...} for the metrics log."""
        out = {f"{kind}_bytes": value for kind, value in sorted(self.bytes.items())}
        out["total_bytes"] = sum(self.bytes.values())
        return out


def _record(ledger: CommLedger | None, kind: str, t: torch.Tensor, group) -> None:
    if ledger is not None and group is not None:
        ledger.record(kind, t.numel(), t.element_size(), dist.get_world_size(group))

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False,
                    ledger: CommLedger | None = None, kind: str = "all_gather"):
    """out = cat([x from rank 0, x from rank 1, ...], dim=0). `kind`: the ledger's name for this traffic."""
    _record(ledger, kind, out, group)
    return _all_gather_single(out, x, group=group, async_op=async_op)


def all_to_all_flat(out: torch.Tensor, x: torch.Tensor, group, ledger: CommLedger | None = None,
                    kind: str = "all_to_all"):
    """out[k-th of N equal pieces] = x[this rank's piece] from rank k (pieces along dim 0). Sends (N-1)/N of x."""
    _record(ledger, kind, x, group)
    return dist.all_to_all_single(out, x, group=group)


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False,
                        ledger: CommLedger | None = None):
    """out = (sum over ranks of x).chunk(size, dim=0)[rank]."""
    _record(ledger, "reduce_scatter", x, group)
    return _reduce_scatter_single(out, x, op=op, group=group, async_op=async_op)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM, ledger: CommLedger | None = None) -> torch.Tensor:
    """In-place all-reduce of `x` over `group` (None: nothing to do); returns `x`, so it chains.

    The one plain all-reduce: ZeRO and data parallelism, the tensor-parallel autograd functions (comms.py) and
    both vocab-parallel cross-entropies call it. A plain collective, not an autograd function: callers that need
    a gradient rule wrap it (parallel/tensor/comms.py). `x` must be contiguous (gloo and NCCL reduce in place)."""
    if group is None:
        return x
    _record(ledger, "all_reduce", x, group)
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_stacked(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(size, *x.shape): every rank's x, stacked along a new leading dim."""
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]) if x.dim() else (size,), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x if x.dim() else x.view(1), group)
    return out.view(size, *x.shape)


def all_reduce_async(x: torch.Tensor, group, op=dist.ReduceOp.SUM, ledger: CommLedger | None = None):
    """Launch an in-place all-reduce of `x` over `group` (not None) and return its work handle: `x` must not be
    read or written until `work.wait()`. Data parallelism's buckets overlap backward with it."""
    _record(ledger, "all_reduce", x, group)
    return dist.all_reduce(x, op=op, group=group, async_op=True)
