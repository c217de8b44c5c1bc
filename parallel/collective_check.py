"""Mismatched collectives named at once: which rank called what, instead of a timeout that names nobody.

torch's own facility is used: `torch.distributed.set_debug_level(DebugLevel.DETAIL)` (what the environment variable
TORCH_DISTRIBUTED_DEBUG=DETAIL sets) wraps every process group created afterwards in torch's ProcessGroupWrapper,
which before each collective all-gathers its fingerprint (per-group sequence number, op type, tensor shapes,
dtypes, devices) over a helper gloo group and raises on every rank of the group when they differ, e.g. rank 1 in
an all-gather while rank 0 is in an all-reduce: the job ends in well under a second instead of after
parallel.timeout_s, and the error names both ranks and both calls. It costs one small extra collective per
collective, so it is opt-in (parallel.check_collectives). Point-to-point ops (the pipeline, gloo's direct
exchange in collectives.py) are not fingerprinted by torch.

On NCCL, torch's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE > 0, dumped by the watchdog on a timeout) is the
ring of each rank's recent collectives; it needs CUDA and is not used or tested here.

Collective: nothing in this module communicates; `enable_collective_checks` must run before the process groups
exist (workers call it through parallel.topology.init_distributed).
"""

from __future__ import annotations

import re

import torch.distributed as dist

_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                          r"OpType=(\w+)(?:, TensorShape=\[([^\]]*)\])?(?:, TensorDtypes=(\w+))?")


def enable_collective_checks() -> None:
    """Fingerprint every collective of the process groups created from now on (torch's DETAIL debug level)."""
    dist.set_debug_level(dist.DebugLevel.DETAIL)


def diagnose_mismatch(error: BaseException) -> str | None:
    """One line from torch's mismatch error ("rank 1 in _ALLGATHER_BASE #3 (shape [4], Float); rank 0 in
    ALLREDUCE #3 (shape [4], Float)"), or None when `error` is not a mismatch of collectives."""
    text = str(error)
    if "Detected mismatch between collectives" not in text:
        return None
    calls = {}  # by rank: the text may hold every rank's error (a launcher gathers them), each naming both calls
    for rank, seq, op, shape, dtype in _FINGERPRINT.findall(text):
        detail = ", ".join(part for part in (f"shape [{shape}]" if shape else "", dtype) if part)
        calls.setdefault(int(rank), f"rank {rank} in {op.lower().lstrip('_')} #{seq}" + (f" ({detail})" if detail else ""))
    if not calls:
        return "collectives diverged between ranks: " + text.splitlines()[0][:300]
    return "collectives diverged: " + "; ".join(calls[rank] for rank in sorted(calls))
