"""qgZ (ZeRO++, Wang et al. 2023): the gradient reduce-scatter as a hierarchical, block-quantized all-to-all.

`zero.quantized_gradients` = "int8" | "int4" (stages 1-3, flat partition or hpZ): every full-size gradient
bucket that the flat reducer would reduce-scatter over dp (chunk r = dp rank r's owned chunk, dp rank r on node
r // per_node at node-local position r % per_node) goes instead through two all-to-alls:

  1. inside the node (`dp_intra_group`): each rank cuts its bucket into the dp chunks, quantizes them (blocks of
     QGZ_BLOCK = 256 elements of one chunk, one scale each) and sends node-local rank b the chunks of every
     node's position b; the receiver dequantizes and sums the per_node copies: the node's partial sum of the
     nodes chunks it forwards.
  2. across nodes (`dp_inter_group`, the same position on every node): each rank requantizes those partial
     sums and sends node a's copy of chunk (a, b) to node a; the receiver dequantizes and sums the nodes
     copies: the sum over all dp ranks of its own chunk, which the reducer then scales by 1/dp as before.

Cross-node bytes per rank: n / per_node x (nodes - 1) / nodes x (1 or 1/2 + 4 / QGZ_BLOCK) for a bucket of n
elements, against n x (dp - 1) / dp x 2-4 bytes for the flat reduce-scatter (whose ring spans the nodes).
Wire format: int8 on -127..127; int4 on -7..7 packed two per byte (low nibble first, stored as q + 8); one fp32
(fp64 for fp64 gradients) scale per block; the last block of each chunk zero-padded.

Error bound (derived; tests/parallel/zero/test_qgz.py holds it). Per element of the owned chunk, let M_r be the max |x| of the
quantization block holding it in rank r's bucket and Q = 127 (int8) or 7 (int4). Rounding to nearest on the
grid M_r / Q errs by at most M_r / (2Q) per sender in step 1, and every dequantized value is at most M_r in size,
so node a's partial sum is at most sum_{r on a} M_r in size and its requantization in step 2 errs by at most
sum_{r on a} M_r / (2Q). In all: |qgZ sum - exact sum| <= sum over all dp ranks of M_r / Q (one level, when dp
fits in a node or a node holds one dp rank: sum M_r / (2Q)), plus the floating-point rounding of the sums. With
`bits = "none"` the same two all-to-alls carry the unquantized values: equal to the flat reduce-scatter up to
the summation order (bit-equal on integer-valued data).

Only gradients on the wire are quantized: the owned fp32 gradient chunks, the masters and AdamW never are.
Collectives: two all-to-alls (values, scales) inside the node, launched asynchronously with the bucket; the
requantization and the two all-to-alls across nodes run when the reduction is waited.
"""

from __future__ import annotations

import torch

from megazoo.parallel.collectives import CommLedger, all_to_all_flat
from megazoo.parallel.zero.quantized import dequantize_blocks, quantize_blocks

QGZ_BLOCK = 256  # elements per quantization block (one scale each), inside one chunk
QGZ_LEVELS = {"int8": 127, "int4": 7}  # symmetric grid -Q..Q
QUANTIZED_GRADIENTS = ("none", "int8", "int4")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in -7..7 (even count) -> uint8, two per byte: q[2i] + 8 in the low nibble, q[2i+1] + 8 high."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[0::2] | (u[1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(2 * packed.numel(), dtype=torch.int8, device=packed.device)
    out[0::2] = (packed & 15).to(torch.int8) - 8
    out[1::2] = (packed >> 4).to(torch.int8) - 8
    return out


def encode_rows(rows: torch.Tensor, bits: str, block: int = QGZ_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scales) of a (r, c) tensor, each row in ceil(c / block) blocks of its own: payload (r, padded c)
    int8, or (r, padded c / 2) uint8 for int4; scales (r, blocks per row)."""
    r, c = rows.shape
    padded_c = -(-c // block) * block
    dtype = torch.promote_types(rows.dtype, torch.float32)
    padded = torch.zeros(r, padded_c, dtype=dtype, device=rows.device)
    padded[:, :c] = rows
    q, scale = quantize_blocks(padded.view(-1), block, QGZ_LEVELS[bits])
    payload = pack_int4(q) if bits == "int4" else q
    return payload.view(r, -1), scale.view(r, -1)


def decode_rows(payload: torch.Tensor, scales: torch.Tensor, c: int, bits: str,
                block: int = QGZ_BLOCK) -> torch.Tensor:
    """The (r, c) dequantized rows of encode_rows' output."""
    r = scales.shape[0]
    q = unpack_int4(payload.reshape(-1)) if bits == "int4" else payload.reshape(-1)
    return dequantize_blocks(q, scales.reshape(-1), block).view(r, -1)[:, :c]


def error_bound(buckets: list[torch.Tensor], per_node: int, bits: str, block: int = QGZ_BLOCK) -> torch.Tensor:
    """The derived bound (module docstring) on |qgZ - exact| for every element of the reduced bucket, from every
    dp rank's full bucket (rank order): sum_r M_r / Q over two levels, / (2Q) over one."""
    dp, n = len(buckets), buckets[0].numel()
    c = n // dp
    padded_c = -(-c // block) * block
    total = torch.zeros(dp, padded_c, dtype=torch.promote_types(buckets[0].dtype, torch.float32))
    for x in buckets:
        rows = torch.zeros_like(total)
        rows[:, :c] = x.view(dp, c).abs()
        total += rows.view(dp, -1, block).amax(dim=2, keepdim=True).expand(-1, -1, block).reshape(dp, -1)
    levels = (per_node > 1) + (dp // per_node > 1)
    return (total[:, :c] * levels / (2 * QGZ_LEVELS[bits])).reshape(-1)


class HierarchicalReduce:
    """The two-level reduce-scatter of one bucket at a time over dp = nodes x per_node ranks (node-major).
    `intra` / `inter`: the node's dp ranks / this position's ranks on every node (None where a level has one
    rank: its step is skipped, with no quantization). `bits`: "int8" | "int4" | "none" (exact wire)."""

    def __init__(self, intra, inter, per_node: int, nodes: int, bits: str, ledger: CommLedger | None = None,
                 block: int = QGZ_BLOCK):
        if bits not in QUANTIZED_GRADIENTS:
            raise ValueError(f"zero.quantized_gradients = {bits!r} is invalid; valid: "
                             f"{', '.join(map(repr, QUANTIZED_GRADIENTS))}")
        self.intra, self.inter, self.per_node, self.nodes = intra, inter, per_node, nodes
        self.bits, self.ledger, self.block = bits, ledger, block

    def _exchange(self, rows: torch.Tensor, group, async_op: bool):
        """All-to-all of the (size x k, c) rows (k consecutive rows per peer): returns (works, decode) where
        decode() gives the received rows, dequantized, as (size, k, c)."""
        size = self.nodes if group is self.inter else self.per_node
        r, c = rows.shape
        if self.bits == "none":
            recv = torch.empty_like(rows)
            works = [all_to_all_flat(recv.view(-1), rows.contiguous().view(-1), group, self.ledger,
                                     async_op=async_op)]
            return works, lambda: recv.view(size, r // size, c)
        payload, scales = encode_rows(rows, self.bits, self.block)
        got_p, got_s = torch.empty_like(payload), torch.empty_like(scales)
        works = [all_to_all_flat(got_p.view(-1), payload.view(-1), group, self.ledger, f"all_to_all_{self.bits}",
                                 async_op=async_op),
                 all_to_all_flat(got_s.view(-1), scales.view(-1), group, self.ledger, "all_to_all_scales",
                                 async_op=async_op)]
        return works, lambda: decode_rows(got_p, got_s, c, self.bits, self.block).view(size, r // size, c)

    def launch(self, out: torch.Tensor, flat: torch.Tensor) -> "PendingReduce":
        """out = this rank's chunk of the sum over dp of `flat`; step 1 launched, step 2 when waited."""
        c = out.numel()
        chunks = flat.view(self.nodes, self.per_node, c)
        if self.intra is None:  # one dp rank per node: this rank's own chunks go straight to step 2
            return PendingReduce(self, out, [], lambda: chunks[:, 0])
        # node-local rank b receives every node's chunk at position b: rows (b, node a) = chunk a x per_node + b
        works, decode = self._exchange(chunks.transpose(0, 1).reshape(self.per_node * self.nodes, c), self.intra,
                                       async_op=True)
        return PendingReduce(self, out, works, lambda: decode().sum(dim=0))  # (nodes, c): the node's partials

    def finish(self, out: torch.Tensor, partial: torch.Tensor) -> None:
        if self.inter is None:
            out.copy_(partial.reshape(-1))
            return
        works, decode = self._exchange(partial, self.inter, async_op=False)  # row a goes to node a
        out.copy_(decode().sum(dim=0).reshape(-1))


class PendingReduce:
    """One bucket's hierarchical reduction: wait() finishes step 1, runs step 2 and writes `out`."""

    def __init__(self, reduce: HierarchicalReduce, out: torch.Tensor, works: list, partial):
        self._reduce, self._out, self._works, self._partial = reduce, out, works, partial

    def wait(self) -> bool:
        if self._partial is not None:
            for work in self._works:
                work.wait()
            partial, self._partial = self._partial, None
            self._reduce.finish(self._out, partial())
        return True
