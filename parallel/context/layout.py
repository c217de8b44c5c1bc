"""The load-balanced split of a causal sequence over cp ranks, and the positions of each rank's tokens.

A sequence of S tokens is cut into 2 x cp chunks of c = S / (2 cp) tokens. cp rank i holds chunk i from the front
and chunk 2cp - 1 - i from the back, side by side (its local sequence has 2c tokens). Under a causal mask the
rows of chunk j see j + 1 chunks' worth of keys, so each rank's work is (i + 1) + (2cp - i) = 2cp + 1 chunk
pairs: the triangle is shared evenly (a plain split would leave the last rank cp times the work of the first).
Everything a rank feeds the model is split the same way: input ids, targets, and the position ids (which are
the tokens' positions in the whole sequence, not 0 .. 2c - 1).
"""

from __future__ import annotations

import torch

from megazoo.parallel.topology import CP_ATTENTION


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) cp rank `cp_rank` holds: one from the front, its mirror from the back."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank = {cp_rank} must be in [0, cp = {cp})")
    return cp_rank, 2 * cp - 1 - cp_rank


def split_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's two chunks of the whole-sequence tensor `x` (length S along `dim`), concatenated."""
    if cp == 1:
        return x
    s = x.shape[dim]
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} is not divisible by 2 x cp = {2 * cp} (the load-balanced causal "
                         "split cuts it into 2 x cp equal chunks)")
    chunks = x.chunk(2 * cp, dim=dim)
    front, back = chunk_ids(cp, cp_rank)
    return torch.cat([chunks[front], chunks[back]], dim=dim)


def position_ranges(local_len: int, cp: int, cp_rank: int) -> list[range]:
    """The runs of whole-sequence positions this rank's `local_len` tokens hold: one run at cp = 1, else its front
    and back chunks. Plain ints, for host-side bookkeeping (the ring's tile plan) without a tensor."""
    if cp == 1:
        return [range(local_len)]
    if local_len % 2:
        raise ValueError(f"a cp rank's sequence holds two equal chunks, but its length is {local_len}")
    c = local_len // 2
    front, back = chunk_ids(cp, cp_rank)
    return [range(front * c, (front + 1) * c), range(back * c, (back + 1) * c)]


def positions(local_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions (in the whole sequence) of this rank's `local_len` tokens: (local_len,) int64, made on `device`."""
    runs = position_ranges(local_len, cp, cp_rank)
    if len(runs) == 1:
        return torch.arange(local_len, device=device)
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in runs])


def gathered_positions(local_len: int, cp: int, device=None) -> torch.Tensor:
    """Positions of the rows of a sequence gathered from every cp rank in cp-rank order (what the all-to-all
    delivers): (cp * local_len,). `x.index_select(dim, gathered_positions.argsort())` puts it in token order,
    and `y.index_select(dim, gathered_positions)` takes a token-ordered tensor back to cp-rank order."""
    return torch.cat([positions(local_len, cp, r, device) for r in range(cp)])


def check_context_layout(cp: int, algorithm: str, seq_len: int, local_heads: int, attn_dropout: float,
                         attention: str = "dense", sliding_window: int = 0) -> None:
    """Raise a ValueError naming the recipe fields when cp context parallelism cannot run this layout."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"parallel.cp = {cp!r} is invalid: it must be a positive integer")
    if algorithm not in CP_ATTENTION:
        raise ValueError(f"parallel.cp_attention = {algorithm!r} is invalid; valid: {', '.join(CP_ATTENTION)}")
    if cp == 1:
        return
    if seq_len % (2 * cp):
        raise ValueError(f"train.seq_len = {seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (each cp rank "
                         f"takes two of 2 x cp equal chunks); valid: a multiple of {2 * cp}")
    if algorithm == "all_to_all" and local_heads % cp:
        raise ValueError(f"parallel.cp_attention = \"all_to_all\" needs the local head count (model.n_head / "
                         f"parallel.tp = {local_heads}) divisible by parallel.cp = {cp}; use cp_attention = "
                         "\"ring\" (any head count), or a cp dividing the local heads")
    if algorithm == "ring" and attention != "dense":  # all-to-all runs the sparse kernel on whole sequences
        raise ValueError(f"parallel.cp_attention = \"ring\" computes dense causal attention, but model.attention = "
                         f"{attention!r}; valid: cp_attention = \"all_to_all\", or model.attention = \"dense\"")
    if algorithm == "ring" and sliding_window:  # all-to-all runs the window's kernel on whole sequences
        raise ValueError(f"parallel.cp_attention = \"ring\" computes full causal attention, but model.sliding_window "
                         f"= {sliding_window}; valid: cp_attention = \"all_to_all\", or model.sliding_window = 0")
    if algorithm == "ring" and attn_dropout > 0:
        raise ValueError(f"parallel.cp_attention = \"ring\" has no attention dropout, but model.attn_dropout = "
                         f"{attn_dropout}; valid: model.attn_dropout = 0, or cp_attention = \"all_to_all\"")
