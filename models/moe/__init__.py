"""Mixture of experts: the MoE block that replaces a block's dense MLP where ModelConfig.moe_layer(i) says so.

One MoE block (block.py) computes, for the tokens x (T, d) of one layer,

    y = sum_{e in top-k(x)} w_e(x) * expert_e(x)  [+ shared(x), times sigmoid(x . g) when gated]

in four pieces, each in its own file:

    router.py    logits = x W_r^T in fp32 (fp64 for fp64 runs), the scoring (softmax, top-k, optional renorm)
    dispatch.py  the token dispatcher: tokens sorted by expert, handed to the experts, combined back
    experts.py   the local experts' computation: ONE grouped matmul over the sorted tokens (torch._grouped_mm),
                 or the per-expert loop it is tested against
    losses.py    the router's statistics per layer and the losses pooled from them (load balancing, z-loss)

The seam for expert parallelism (parallel/expert/ provides the all-to-all dispatcher)
---------------------------------------------------------------------------------------
The block never moves tokens itself: it calls a token dispatcher, an object with

    dispatcher.local_experts -> range
        the global indices of the experts this rank holds, contiguous: range(0, E) at ep = 1 (LocalDispatcher),
        range(r * E / ep, (r + 1) * E / ep) on ep rank r. The block allocates only these experts' weights, stacked
        in this order (experts.py: ExpertWeights, global shape (E, ...), dim 0 split over ep).

    dispatcher(x, weights, indices, experts) -> Dispatched(out, counts, dropped)
        x        (T, d)  this rank's tokens (after the layer's norm)
        weights  (T, k)  the router's combine weights of the chosen experts (fp32 or wider)
        indices  (T, k)  int64 global expert indices in [0, E)
        experts  a callable experts(tokens, counts) -> (N, d): the expert computation on this rank's local
                 experts, `tokens` (N, d) sorted by local expert (all of local expert 0's rows, then 1's, ...),
                 `counts` (len(local_experts),) int64 rows per local expert on the tokens' device (sum = N);
                 it is `ExpertComputation.__call__` (experts.py: expert_ffn over the stacked weights), so a
                 dispatcher wraps it and never sees the weights
        out      (T, d)  sum_j weights[t, j] * expert_{indices[t, j]}(x[t]) in x's dtype, for kept assignments
        counts   (E,) int64  assignments routed to each global expert (before any dropping): the load statistic
        dropped  ()   int64  assignments dropped by the capacity factor (0 when dropless)

        same_shapes  (keyword, default False) every rank of the ep group routes as many rows (the block passes
                 its training flag): a capacity factor's padded splits are then known on every rank
    It is differentiable in x and weights (and, through `experts`, in the experts' weights). At ep = 1 it reads
    no tensor on the host (a capacity factor pads every expert to its capacity: static shapes); at ep > 1 the
    uneven all-to-all reads its split sizes once per layer forward (parallel/expert/dispatch.exchange_rows), none
    with a capacity factor in training. The combine adds each token's contributions in expert order (as
    transformers' loop does).

`make_dispatcher(cfg, topo)` (dispatch.py) is the one place that chooses it: LocalDispatcher at ep = 1; the
all-to-all dispatcher of parallel/expert/ plugs in there with the same interface.

Tensor parallelism: experts run at expert-tp 1, replicated over the tp ranks (router and gate replicated too);
the shared experts are a tensor-parallel SwiGLU like the dense MLP. Without sequence parallelism every tp rank
routes all the (replicated) tokens and computes all experts on them: the same result, redundant work. With
sequence parallelism each tp rank routes and computes only its own s / tp positions (no redundancy) and the
replicated weights' gradients are all-reduced over tp (SequenceParallel.replicated), as Megatron requires sequence
parallelism for MoE under tp.
"""

from megazoo.models.moe.block import MoE
from megazoo.models.moe.dispatch import Dispatched, LocalDispatcher, TokenDispatcher, make_dispatcher
from megazoo.models.moe.experts import ExpertComputation, expert_ffn, grouped_mm_unsupported
from megazoo.models.moe.losses import RouterStats, load_balancing_loss, z_loss
from megazoo.models.moe.router import Router, route

__all__ = ["Dispatched", "ExpertComputation", "LocalDispatcher", "MoE", "Router", "RouterStats", "TokenDispatcher",
           "expert_ffn", "grouped_mm_unsupported", "load_balancing_loss", "make_dispatcher", "route", "z_loss"]
