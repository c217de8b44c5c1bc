"""What the tensor-parallel layer tests share: shapes, the fp32 tolerance, seeded inputs, running a function on
one tp group of forked ranks, and which columns a rank owns."""

import torch
from harness import run_distributed

from megazoo.parallel.topology import Topology

TPS = (2, 4)
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32, O(1) values: only the summation order differs from the reference
B, S = 2, 3


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def on_tp(tp, fn, *args):
    """Run fn(topology, *args) on `tp` ranks forming one tensor-parallel group; per-rank results."""

    def body(*a):
        return fn(Topology.build(dp=1, tp=tp), *a)

    return run_distributed(body, tp, *args)


def own_columns(total, sections, rank, tp):
    """Indices (along the split dim) of the global tensor that `rank` holds: its piece of every section."""
    block = total // sections
    piece = block // tp
    return torch.cat([torch.arange(s * block + rank * piece, s * block + (rank + 1) * piece) for s in range(sections)])
