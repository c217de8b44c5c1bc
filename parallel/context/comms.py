"""The communication of context (sequence) parallelism, over the cp group of the Topology.

| function / class     | forward                                           | backward                               |
|----------------------|---------------------------------------------------|----------------------------------------|
| seq_to_head_shards   | all-to-all: (b, h, s/cp, hd) -> (b, h/cp, s, hd)  | the inverse all-to-all                 |
| head_to_seq_shards   | all-to-all: (b, h/cp, s, hd) -> (b, h, s/cp, hd)  | the inverse all-to-all                 |
| RingExchange         | async send to cp rank + 1 / receive from rank - 1 | (ring attention's backward uses it too)|
| all_reduce_count     | all-reduce (sum) of a token count                 | none (a count has no gradient)         |

`attention_comm_bytes` is the formula for the bytes these move per layer (tested against counted bytes).

A `None` group (cp = 1) makes every one of them the identity. Sequence-sharded tensors hold this rank's two
load-balanced chunks (layout.py); the all-to-all gathers them in cp-rank order, which is *not* token order
(layout.py: `gathered_order` says where each gathered row belongs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazoo.parallel.topology import group_rank, group_size


def _all_to_all_dim(x: torch.Tensor, group, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Split `x` into cp pieces along `split_dim`, send piece j to cp rank j, concatenate what arrives (in cp-rank
    order) along `cat_dim`. Collective: one all_to_all_single over the cp group."""
    cp = group_size(group)
    if x.shape[split_dim] % cp:
        raise ValueError(f"dim {split_dim} of size {x.shape[split_dim]} is not divisible by the cp size {cp}")
    pieces = x.chunk(cp, dim=split_dim)
    send = torch.stack(pieces, dim=0).contiguous()  # (cp, ...): piece j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=cat_dim)  # rank j's piece at position j


class _SeqToHead(torch.autograd.Function):
    """Forward: all-to-all, heads split / sequence gathered. Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all_dim(x, group, split_dim=1, cat_dim=2)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_dim(grad, ctx.group, split_dim=2, cat_dim=1), None


class _HeadToSeq(torch.autograd.Function):
    """Forward: all-to-all, sequence split / heads gathered. Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all_dim(x, group, split_dim=2, cat_dim=1)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_dim(grad, ctx.group, split_dim=1, cat_dim=2), None


def seq_to_head_shards(x: torch.Tensor, group) -> torch.Tensor:
    """(b, h, s/cp, hd) sequence-sharded -> (b, h/cp, s, hd) head-sharded, sequence in cp-rank order."""
    return x if group is None else _SeqToHead.apply(x, group)


def head_to_seq_shards(x: torch.Tensor, group) -> torch.Tensor:
    """(b, h/cp, s, hd) head-sharded (sequence in cp-rank order) -> (b, h, s/cp, hd) sequence-sharded."""
    return x if group is None else _HeadToSeq.apply(x, group)


class RingExchange:
    """Pass tensors one step around the cp ring: send to cp rank + 1 while receiving from cp rank - 1.

    `start(tensors)` posts every send and receive at once (one batch_isend_irecv: with cp = 2 both neighbours
    are the same rank, and batching keeps NCCL from blocking a send on its unposted receive) and returns at
    once, so the caller computes on the current block while the next one travels; `wait()` returns the
    received tensors. Tensors must be contiguous; the receive buffers are fresh (the sent ones stay untouched
    until wait() returns)."""

    def __init__(self, group, tag: int = 0):
        self.group, self.tag = group, tag  # gloo matches by tag too; NCCL by posting order (the same on all ranks)
        cp, rank = group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)
        self._works, self._recv, self._sent = [], [], []

    def start(self, tensors: list[torch.Tensor]) -> None:
        assert not self._works, "wait() for the previous exchange first"
        self._sent = [t.contiguous() for t in tensors]  # alive until the sends complete
        self._recv = [torch.empty_like(t) for t in self._sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, self.tag) for t in self._sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, self.tag) for r in self._recv]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works, received = [], self._recv
        self._recv, self._sent = [], []
        return received


def all_reduce_count(count: torch.Tensor, group) -> torch.Tensor:
    """The sum of an integer count over the cp group (no gradient flows through a count)."""
    if group is None:
        return count
    count = count.clone()
    dist.all_reduce(count, group=group)
    return count


def attention_comm_bytes(algorithm: str, cp: int, b: int, heads: int, seq_len: int, head_dim: int,
                         element_bytes: int, grad_element_bytes: int | None = None) -> dict[str, float]:
    """Bytes one rank sends for one attention call (one layer, one micro-batch) over the cp group, forward and
    backward. `heads`: this rank's heads before the split (n_head / tp); `seq_len`: the whole sequence.

    all_to_all: 4 all-to-alls each way (q, k, v, y; in backward their gradients), each sending (cp - 1) / cp of
    the rank's (b, heads, s/cp, hd) tensor. ring: forward cp - 1 hops of (K, V); backward cp - 1 hops of (K, V)
    and cp hops of the (dK, dV) accumulators (kept in fp32 at least: `grad_element_bytes`)."""
    local = b * heads * (seq_len // cp) * head_dim  # elements of one of q, k, v on this rank
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0}
    if algorithm == "all_to_all":
        one = local * element_bytes * (cp - 1) / cp
        return {"forward": 4 * one, "backward": 4 * one}
    grad_bytes = grad_element_bytes or max(element_bytes, 4)
    kv = 2 * local * element_bytes
    return {"forward": (cp - 1) * kv, "backward": (cp - 1) * kv + cp * 2 * local * grad_bytes}
