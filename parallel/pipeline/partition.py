"""Which blocks each pipeline stage holds.

A model of n_layer blocks is cut into pp x v contiguous *virtual stages* (v = 1 unless interleaved). Virtual
stage s lives on pipeline rank s % pp as that rank's model chunk s // pp, so with interleaving a rank holds
v non-adjacent slices of the model (zbv's V placement: rank r holds stages r and 2 pp - 1 - r). The first virtual stage also holds the embeddings, the last the final
LayerNorm and the (tied) LM head.
"""

from __future__ import annotations

from typing import Sequence

PARTITION_METHODS = ("uniform", "parameters")


def uniform_stage_layers(n_layer: int, parts: int) -> list[range]:
    """Blocks of each of `parts` stages, as even as possible; the first n_layer % parts stages get one more."""
    base, extra = divmod(n_layer, parts)
    out, start = [], 0
    for s in range(parts):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _balanced(weights: Sequence[float], parts: int) -> list[list[int]]:
    """Contiguous split minimising the largest part's weight (binary search on the bound, greedy fill)."""
    n = len(weights)

    def cuts_for(bound: float) -> list[int] | None:
        cuts, total = [], 0.0
        for i, w in enumerate(weights):
            left_items, left_parts = n - i, parts - len(cuts)
            if (total + w > bound and total > 0) or left_items < left_parts:
                cuts.append(i)
                total = 0.0
            total += w
            if w > bound:
                return None
        return cuts if len(cuts) == parts - 1 else None

    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        if cuts_for(mid) is None:
            lo = mid
        else:
            hi = mid
    cuts = cuts_for(hi) or []
    bounds = [0, *cuts, n]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(parts)]


def virtual_stage_layers(n_layer: int, pp: int, *, virtual: int = 1, method: str = "uniform",
                         layers: Sequence[Sequence[int]] | None = None,
                         block_weights: Sequence[float] | None = None,
                         first_extra: float = 0.0, last_extra: float = 0.0) -> list[list[int]]:
    """Block indices of each virtual stage (pp x virtual lists, in pipeline order).

    method "uniform" splits by block count; "parameters" balances parameter counts, counting the embedding
    (`first_extra`) and the head (`last_extra`) on the stages that hold them. An explicit `layers` list wins and
    must cover every block exactly once, in order.
    """
    parts = pp * virtual
    if pp < 1 or virtual < 1:
        raise ValueError(f"parallel.pp = {pp} and parallel.virtual_stages = {virtual} must be >= 1")
    if parts > n_layer:
        raise ValueError(f"parallel.pp x parallel.virtual_stages = {pp} x {virtual} = {parts} stages is more than "
                         f"the model's {n_layer} blocks; valid: pp x virtual_stages <= {n_layer}")
    if layers is not None:
        layers = [list(stage) for stage in layers]
        if len(layers) != parts:
            raise ValueError(f"parallel.layers has {len(layers)} stages but pp x virtual_stages = {parts}")
        flat = [i for stage in layers for i in stage]
        if flat != list(range(n_layer)) or any(not stage for stage in layers):
            raise ValueError(f"parallel.layers = {layers} must list every block 0..{n_layer - 1} exactly once, "
                             "in order, with at least one block per stage")
        return layers
    if method == "uniform":
        return [list(stage) for stage in uniform_stage_layers(n_layer, parts)]
    if method == "parameters":
        weights = list(block_weights) if block_weights is not None else [1.0] * n_layer
        weights[0] += first_extra
        weights[-1] += last_extra
        return _balanced(weights, parts)
    raise ValueError(f"parallel.partition = {method!r} is invalid; valid: {', '.join(PARTITION_METHODS)}")


def rank_chunks(stages: list[list[int]], pp: int, pp_rank: int, placement: str = "loop") -> list[int]:
    """The virtual stages this pipeline rank holds, in chunk order: every pp-th from pp_rank ("loop"), or the
    V's two arms, pp_rank and 2 pp - 1 - pp_rank ("v": zbv; the first rank holds the first and the last stage)."""
    if placement == "v":
        return [pp_rank, len(stages) - 1 - pp_rank]
    return list(range(pp_rank, len(stages), pp))
