"""The compressed all-reduce of 1-bit / 0-1 Adam: two collectives of sign bits, error feedback on both sides.

| function                 | collectives (over the dp group)                     | bytes each rank sends         |
|--------------------------|-----------------------------------------------------|-------------------------------|
| compressed_all_reduce    | all-to-all of packed chunks, all-gather of packed   | ~2 n / 8 x (N-1)/N (+ scales) |
|                          | server chunks                                       |                               |
| (full-precision, for     | all-reduce (sum)                                    | 2 n x 4 x (N-1)/N (fp32)      |
|  comparison)             |                                                     |                               |

No autograd here: it runs in the optimizer step, on momenta (1-bit Adam), gradients or accumulated updates
(0/1 Adam). For a flat x of n elements (n a multiple of 8 N, see `padded_numel`) on each of N ranks:

  worker  y = x + worker_error; split y into N chunks of c = n / N; chunk j becomes (signs, scale_j) with
          scale_j = ||y_j|| / sqrt(c); worker_error = y - scale * sign(y). Chunk j is sent to rank j (all-to-all).
  server  rank r holds the N compressed versions of chunk r: z = (sum_k scale_k sign_k) / N + server_error;
          t = ||z|| / sqrt(c); server_error = z - t sign(z); (signs of z, t) go to every rank (all-gather).
  result  x = concatenation over r of t_r sign(z_r), identical on every rank.

The error buffers carry what each compression dropped into the next call, so nothing is lost over time (the
1-bit Adam paper's error-compensated compression on workers and server). With a group of one rank (None) the
same arithmetic runs without collectives, so one process trains the same algorithm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazoo.parallel.collectives import CommLedger, all_gather_flat, all_to_all_flat
from megazoo.parallel.compressed.packing import decode, encode

ALL_TO_ALL_KIND, ALL_GATHER_KIND = "compressed_all_to_all", "compressed_all_gather"


def padded_numel(n: int, world: int) -> int:
    """n rounded up to a multiple of 8 x world: every rank's chunk packs into whole bytes."""
    unit = 8 * world
    return -(-n // unit) * unit


@torch.no_grad()
def compressed_all_reduce(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group,
                          ledger: CommLedger | None = None) -> torch.Tensor:
    """Replace flat `x` (numel a multiple of 8 x N) by the compressed average over `group`, in place; update
    both error buffers (worker_error like x, server_error n / N). Collectives: one all-to-all and one
    all-gather of uint8 (signs + one scale per chunk). Returns x."""
    gathered = compressed_average_packed(x, worker_error, server_error, group, ledger)
    # every rank decodes the same bytes: the result is identical everywhere
    x.view(gathered.shape[0], -1).copy_(decode(gathered, x.dtype))
    return x


@torch.no_grad()
def compressed_average_packed(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group,
                              ledger: CommLedger | None = None) -> torch.Tensor:
    """compressed_all_reduce without its last decode: returns the all-gathered wire (N rows of packed signs +
    scale, identical on every rank; `decode(wire, dtype).view(-1)` is the average). x is left holding
    x + worker_error. 1-bit Adam at ZeRO-1 keeps its momentum in this form between steps (n / 8 bytes)."""
    world = dist.get_world_size(group) if group is not None else 1
    n = x.numel()
    if n % (8 * world) or worker_error.numel() != n or server_error.numel() != n // world:
        raise ValueError(f"compressed_all_reduce: x has {n} elements (must be a multiple of 8 x {world}), "
                         f"worker_error {worker_error.numel()}, server_error {server_error.numel()}")
    c = n // world
    # worker: compensate, compress each destination chunk, keep what the compression dropped
    y = x.add_(worker_error).view(world, c)
    wire, sent = encode(y)
    torch.sub(y, sent, out=worker_error.view(world, c))
    received = torch.empty_like(wire)
    if group is None:
        received.copy_(wire)
    else:
        all_to_all_flat(received, wire, group, ledger=ledger, kind=ALL_TO_ALL_KIND)
    # server: average this rank's chunk over the workers, compensate, compress again
    z = decode(received, x.dtype).sum(dim=0).div_(world).add_(server_error)
    server_wire, server_sent = encode(z.view(1, c))
    torch.sub(z, server_sent.view(c), out=server_error)
    gathered = torch.empty((world, server_wire.shape[1]), dtype=torch.uint8, device=x.device)
    if group is None:
        gathered.copy_(server_wire)
    else:
        all_gather_flat(gathered, server_wire, group, ledger=ledger, kind=ALL_GATHER_KIND)
    return gathered
