"""Thin, version-tolerant names for the flat collectives (torch 2.13 renamed the *_into_tensor forms), which
algorithm runs them on which backend, and the ledger that counts what they move.

Both take/produce tensors concatenated along dim 0: all_gather_flat(out[size * n, ...], x[n, ...]).

Why not always the backend's own collective: gloo's all-gather and reduce-scatter are several times slower than
the same bytes moved by its point-to-point ops (2 ranks, 64 MB fp32 on this 2-core machine: reduce-scatter
200 ms, all-gather 138 ms, gloo's all-reduce of the whole 70 ms; one batch of isend/irecv: 40 ms and 29 ms;
`python -m benchmarks.collectives` prints it). ZeRO moves every parameter and gradient through these two, so on
gloo a message of P2P_MIN_BYTES or more goes as a direct exchange: every rank sends each peer that peer's piece
in one batch of point-to-point ops (the same (N-1)/N of the tensor a ring sends) and, for a reduce-scatter, sums
the pieces it received when waited. NCCL (and the dry run's fake backend, which stands for it) keep their own.
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
    (The ZeRO paper's communication volume, measured rather than derived.)

    With `node_size` (processes per node, global ranks filling nodes in order) the same bytes are also added
    up per link class in `link_bytes`: "intra" when every rank of the group is on one node, else "inter". A ring
    over a group that spans nodes runs at the pace of its slowest (cross-node) hop, so all of its bytes count as
    inter-node, as the ZeRO++ paper counts ZeRO-3's cross-node volume (3 x params per step)."""

    elements: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    node_size: int = 0  # 0: nodes unknown, no link classes
    link_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def record(self, kind: str, numel: int, element_size: int, group_size: int, link: str | None = None) -> None:
        factor = (2.0 if kind == "all_reduce" else 1.0) * (group_size - 1) / group_size
        self.elements[kind] += numel * factor
        self.bytes[kind] += numel * factor * element_size
        self.calls[kind] += 1
        if link is not None:
            self.link_bytes[link] += numel * factor * element_size

    def reset(self) -> None:
        self.elements.clear()
        self.bytes.clear()
        self.calls.clear()
        self.link_bytes.clear()

    def summary(self) -> dict[str, float]:
        """{'<kind>_bytes': ..., 'total_bytes': ...} for the metrics log."""
        out = {f"{kind}_bytes": value for kind, value in sorted(self.bytes.items())}
        out["total_bytes"] = sum(self.bytes.values())
        return out


def link_class(group, node_size: int) -> str:
    """"intra" when every rank of `group` sits on one node of `node_size` consecutive global ranks, else "inter"."""
    ranks = dist.get_process_group_ranks(group)
    return "intra" if min(ranks) // node_size == max(ranks) // node_size else "inter"


def _record(ledger: CommLedger | None, kind: str, t: torch.Tensor, group) -> None:
    if ledger is not None and group is not None:
        link = link_class(group, ledger.node_size) if ledger.node_size > 0 else None
        ledger.record(kind, t.numel(), t.element_size(), dist.get_world_size(group), link)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


P2P_MIN_BYTES = 4 << 20  # from here gloo's point-to-point exchange beats its all-gather / reduce-scatter (measured)


def _exchanges(x: torch.Tensor, group) -> bool:
    """Run this collective as a direct point-to-point exchange? gloo, at least P2P_MIN_BYTES, several ranks."""
    return (x.numel() * x.element_size() >= P2P_MIN_BYTES and dist.get_backend(group) == "gloo"
            and dist.get_world_size(group) > 1)


class Exchange:
    """A collective done as one batch of isend/irecv. wait() finishes the transfers, then `finish` (the sum of
    a reduce-scatter's received pieces) once; the tensors must not be touched until then, as with any async
    collective. Every rank posts its exchanges in the same order, so the pairs' messages match in order."""

    def __init__(self, works: list, finish=None):
        self._works, self._finish = works, finish

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


def _peers(group) -> tuple[int, list[int]]:
    return dist.get_rank(group), dist.get_process_group_ranks(group)


def _exchange_all_gather(out: torch.Tensor, x: torch.Tensor, group) -> Exchange:
    me, ranks = _peers(group)
    pieces = out.chunk(len(ranks))
    ops = [dist.P2POp(dist.isend, x, peer, group) for i, peer in enumerate(ranks) if i != me]
    ops += [dist.P2POp(dist.irecv, pieces[i], peer, group) for i, peer in enumerate(ranks) if i != me]
    works = dist.batch_isend_irecv(ops)
    pieces[me].copy_(x)
    return Exchange(works)


def _exchange_reduce_scatter(out: torch.Tensor, x: torch.Tensor, group) -> Exchange:
    """Each peer's piece of x goes to it; this rank receives every peer's copy of its own piece (2 ranks: into
    `out` itself; more: into a scratch of N-1 pieces) and adds them in rank order when waited."""
    me, ranks = _peers(group)
    pieces = x.chunk(len(ranks))
    others = [i for i in range(len(ranks)) if i != me]
    received = [out] if len(others) == 1 else list(torch.empty((len(others), *out.shape), dtype=out.dtype,
                                                               device=out.device).unbind(0))
    ops = [dist.P2POp(dist.isend, pieces[i], ranks[i], group) for i in others]
    ops += [dist.P2POp(dist.irecv, buf, ranks[i], group) for i, buf in zip(others, received)]
    works = dist.batch_isend_irecv(ops)
    in_rank_order = [t for _, t in sorted([(me, pieces[me]), *zip(others, received)], key=lambda pair: pair[0])]

    def finish():
        torch.add(in_rank_order[0], in_rank_order[1], out=out)  # 2 ranks: out is one of them (elementwise add)
        for part in in_rank_order[2:]:
            out.add_(part)
    return Exchange(works, finish)


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False,
                    ledger: CommLedger | None = None, kind: str = "all_gather"):
    """out = cat([x from rank 0, x from rank 1, ...], dim=0). `kind`: the ledger's name for this traffic."""
    _record(ledger, kind, out, group)
    if _exchanges(out, group):
        work = _exchange_all_gather(out, x, group)
        if not async_op:
            work.wait()
            return None
        return work
    return _all_gather_single(out, x, group=group, async_op=async_op)


def all_to_all_flat(out: torch.Tensor, x: torch.Tensor, group, ledger: CommLedger | None = None,
                    kind: str = "all_to_all", async_op: bool = False):
    """out[k-th of N equal pieces] = x[this rank's piece] from rank k (pieces along dim 0). Sends (N-1)/N of x."""
    _record(ledger, kind, x, group)
    return dist.all_to_all_single(out, x, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False,
                        ledger: CommLedger | None = None):
    """out = (sum over ranks of x).chunk(size, dim=0)[rank]."""
    _record(ledger, "reduce_scatter", x, group)
    if op == dist.ReduceOp.SUM and _exchanges(x, group):
        work = _exchange_reduce_scatter(out, x, group)
        if not async_op:
            work.wait()
            return None
        return work
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
