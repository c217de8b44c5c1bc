"""Causal attention over a sequence split across the cp group (layout.py's load-balanced chunks).

Every function takes this rank's q, k, v of shape (b, h, s/cp, hd), its two chunks side by side, and returns the
attention output for its own queries, (b, h, s/cp, hd): exactly the rows of dense causal attention over the
whole sequence that this rank holds.

- `ulysses_attention` (DeepSpeed-Ulysses): all-to-all to head shards (b, h/cp, s, hd), reorder the gathered
  sequence into token order, run the ordinary causal attention kernel on whole sequences of h/cp heads, and
  all-to-all back. Needs h divisible by cp. Collectives: forward 4 all-to-alls (q, k, v in, y out), backward 4.
- `ring_attention`: q stays; the K/V block of every cp rank passes once around the ring, and each block's
  attention is merged into the output with the online softmax (running log-sum-exp). Any head count. The next
  block's send/receive is posted before the current block is computed (overlap). Backward passes K/V around the
  ring again with dK/dV accumulators travelling with their block, and one last hop takes each accumulator home.
  Collectives: forward cp - 1 ring exchanges of (K, V); backward cp - 1 of (K, V) and cp of (dK, dV).

Per chunk pair (query chunk a, key chunk c): a > c full attention, a == c causal, a < c nothing (skipped). The
ring computes each block in tiles of TILE rows with the same online-softmax merge (flash-attention's scheme in
plain torch ops), so its temporaries are O(TILE^2) and it stores only q, k, v, the output and the log-sum-exp.
On GPU a fused per-block kernel returning the log-sum-exp would be faster; this is the portable reference path.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from megazoo.parallel.context.comms import RingExchange, head_to_seq_shards, seq_to_head_shards
from megazoo.parallel.context.layout import gathered_positions, position_ranges
from megazoo.parallel.topology import CP_ATTENTION as ALGORITHMS, group_rank, group_size

Attend = Callable[..., torch.Tensor]  # (q, k, v, dropout_p) -> y, causal, all (b, h, s, hd)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, attend: Attend,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Sequence-sharded q, k, v -> head-sharded whole sequences -> `attend` (causal) -> sequence-sharded y."""
    if group is None:
        return attend(q, k, v, dropout_p)
    cp, heads = group_size(group), q.shape[1]
    if heads % cp:
        raise ValueError(f"all_to_all context parallelism needs the local head count ({heads}) divisible by "
                         f"cp = {cp}; use parallel.cp_attention = \"ring\" (any head count)")
    gathered = gathered_positions(q.shape[2], cp, q.device)  # row j of the gathered sequence is token gathered[j]
    to_tokens = gathered.argsort()
    q, k, v = (seq_to_head_shards(t, group).index_select(2, to_tokens) for t in (q, k, v))  # (b, h/cp, s, hd)
    y = attend(q, k, v, dropout_p)  # token order: the kernel's plain causal mask is the right one
    return head_to_seq_shards(y.index_select(2, gathered), group)  # (b, h, s/cp, hd)


TILE = 128  # query / key rows per tile: a tile pair's temporaries are O(TILE^2), whatever the sequence length


def _position_list(local_len: int, cp: int, rank: int) -> list[int]:
    """Rank `rank`'s token positions as Python ints (no tensor, no read back from the device)."""
    return [pos for run in position_ranges(local_len, cp, rank) for pos in run]


def _tiles(local_len: int, tile: int) -> list[tuple[int, int]]:
    """Row ranges of at most `tile` rows that never cross the boundary between a rank's two chunks, so the
    positions inside a tile are consecutive."""
    c = local_len // 2
    return [(h * c + i, h * c + min(i + tile, c)) for h in (0, 1) for i in range(0, c, tile)]


def _tile_pairs(q_pos: list[int], k_pos: list[int], tiles: list[tuple[int, int]]):
    """(query rows, key rows, causal) for every tile pair with at least one visible key; `causal` when some
    keys of the pair lie in the future of some queries (then the pair is a diagonal one: same positions)."""
    for i0, i1 in tiles:
        for j0, j1 in tiles:
            if k_pos[j0] > q_pos[i1 - 1]:
                continue  # every key after every query
            yield (i0, i1), (j0, j1), k_pos[j1 - 1] > q_pos[i0]


def _scores(q, k, scale: float, causal: bool):
    scores = (q @ k.transpose(-2, -1)) * scale  # (b, h, tq, tk)
    if causal:  # a diagonal tile: the same positions on both sides
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


class _RingAttention(torch.autograd.Function):
    """Forward: cp - 1 ring exchanges of (K, V), each overlapping a block's attention. Backward: cp - 1 ring
    exchanges of (K, V) and cp of the (dK, dV) accumulators (the last one takes each home).

    Each block is computed tile pair by tile pair (flash-attention style, in plain torch ops): the running
    (output, log-sum-exp) of every query row is merged with each tile's, so no (s/cp)^2 scores ever exist."""

    @staticmethod
    def forward(ctx, q, k, v, group, tile):
        cp, rank = group_size(group), group_rank(group)
        dtype = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in fp32 at least
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
        tiles, q_pos = _tiles(n, tile), _position_list(n, cp, rank)
        qd = q.to(dtype)
        out = torch.zeros_like(qd)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        ring = RingExchange(group, tag=1)
        k_cur, v_cur = k, v
        for t in range(cp):
            if t < cp - 1:
                ring.start([k_cur, v_cur])  # the next block travels while this one is computed
            kd, vd, k_pos = k_cur.to(dtype), v_cur.to(dtype), _position_list(n, cp, (rank - t) % cp)
            for (i0, i1), (j0, j1), causal in _tile_pairs(q_pos, k_pos, tiles):
                scores = _scores(qd[:, :, i0:i1], kd[:, :, j0:j1], scale, causal)
                lse_b = scores.logsumexp(dim=-1)  # (b, h, tq): finite, every row sees a key
                o_b = (scores - lse_b.unsqueeze(-1)).exp() @ vd[:, :, j0:j1]
                old = lse[:, :, i0:i1]
                new = torch.logaddexp(old, lse_b)  # online softmax: rescale both to the merged normaliser
                out[:, :, i0:i1] = (out[:, :, i0:i1] * (old - new).exp().unsqueeze(-1)
                                    + o_b * (lse_b - new).exp().unsqueeze(-1))
                lse[:, :, i0:i1] = new
            if t < cp - 1:
                k_cur, v_cur = ring.wait()
        # Saved: the output as returned (in q's dtype, the very tensor the output projection keeps, so no second
        # copy: FlashAttention's choice too) and the fp32 log-sum-exp; backward's rowsum(dO * O) reads it.
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.tile = group, tile
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, rank = group_size(group), group_rank(group)
        dtype, n, scale = lse.dtype, q.shape[2], 1.0 / math.sqrt(q.shape[-1])
        tiles, q_pos = _tiles(n, ctx.tile), _position_list(n, cp, rank)
        qd, do = q.to(dtype), grad.to(dtype)
        delta = (do * out.to(dtype)).sum(-1)  # rowsum(dO * O): the softmax backward's correction, (b, h, n)
        dq = torch.zeros_like(qd)
        kv_ring, dkv_ring = RingExchange(group, tag=2), RingExchange(group, tag=3)
        k_cur, v_cur = k, v
        for t in range(cp):
            if t < cp - 1:
                kv_ring.start([k_cur, v_cur])
            kd, vd, k_pos = k_cur.to(dtype), v_cur.to(dtype), _position_list(n, cp, (rank - t) % cp)
            dk, dv = torch.zeros_like(kd), torch.zeros_like(vd)
            for (i0, i1), (j0, j1), causal in _tile_pairs(q_pos, k_pos, tiles):
                qi, kj, vj, doi = qd[:, :, i0:i1], kd[:, :, j0:j1], vd[:, :, j0:j1], do[:, :, i0:i1]
                p = (_scores(qi, kj, scale, causal) - lse[:, :, i0:i1].unsqueeze(-1)).exp()  # final probabilities
                dv[:, :, j0:j1] += p.transpose(-2, -1) @ doi
                ds = p * (doi @ vj.transpose(-2, -1) - delta[:, :, i0:i1].unsqueeze(-1))
                dq[:, :, i0:i1] += (ds @ kj) * scale
                dk[:, :, j0:j1] += (ds.transpose(-2, -1) @ qi) * scale
            if t > 0:  # the accumulator of this block, from the ranks that held it before (computed meanwhile)
                dk_in, dv_in = dkv_ring.wait()
                dk, dv = dk + dk_in, dv + dv_in
            dkv_ring.start([dk, dv])  # on to the next rank; after the last step, home to the block's owner
            if t < cp - 1:
                k_cur, v_cur = kv_ring.wait()
        dk, dv = dkv_ring.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, tile: int = TILE) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys, K/V passed around the cp ring."""
    if group is None:
        return _dense_causal(q, k, v)  # one rank: the whole sequence is here
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs a local sequence of two equal chunks, got length {q.shape[2]}")
    return _RingAttention.apply(q, k, v, group, _tile_for(q, tile))


FAKE_TILES_PER_RANK = 8


def _tile_for(q: torch.Tensor, tile: int) -> int:
    """The tile, or under fake tensors (the dry run: recipes/dry_run/run.py) one of at most
    FAKE_TILES_PER_RANK per rank: the tile loop runs in Python, ~10 ops per tile pair under four dispatch modes,
    and 128-row tiles of long-context.toml's 4,096 local rows are ~4K tile pairs per layer (hours a step). The
    same ops run on larger tiles; their O(tile^2) temporaries are counted as they are, an upper bound of the
    real tiles' (at 4,096 rows: 512-row tiles, fp32 scores of (b, h, 512, 512))."""
    from torch._subclasses.fake_tensor import is_fake

    return max(tile, q.shape[2] // FAKE_TILES_PER_RANK) if is_fake(q) else tile


def _dense_causal(q, k, v):
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = _scores(q.to(dtype), k.to(dtype), 1.0 / math.sqrt(q.shape[-1]), causal=True)
    return (scores.softmax(dim=-1) @ v.to(dtype)).to(q.dtype)


def context_attention(attend: Attend, group, algorithm: str) -> Attend:
    """`attend` (a causal kernel for whole sequences) made to work on cp-split sequences: fn(q, k, v, dropout_p).
    With no cp group (cp = 1) it is `attend` itself."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"parallel.cp_attention = {algorithm!r} is invalid; valid: {', '.join(ALGORITHMS)}")
    if group is None:
        return attend
    if algorithm == "all_to_all":
        return lambda q, k, v, dropout_p=0.0: ulysses_attention(q, k, v, group, attend, dropout_p)

    def ring(q, k, v, dropout_p=0.0):
        if dropout_p > 0:
            raise ValueError("ring attention has no attention dropout: set model.attn_dropout = 0, or use "
                             "parallel.cp_attention = \"all_to_all\"")
        return ring_attention(q, k, v, group)

    return ring
