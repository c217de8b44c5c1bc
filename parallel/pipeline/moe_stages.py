"""One MoE layer as fb_overlap.py's sub-stages: route | counts | dispatch | experts | combine | after.

The same math as parallel/expert/dispatch.dispatch_combine (stable sort of the (token, expert) pairs by expert,
the count exchange and its one host read, the uneven all-to-all, the regroup to expert-major, the experts, and
back), cut at its two row all-to-alls so that each can travel while another micro-batch computes. A block
supplies what surrounds the experts:

- before(ctx, inputs) -> h [..., d], or (h, *carry): whatever precedes the MoE (attention, norms; the embedding on
  a first stage); its rows h.reshape(-1, d) [T, d] are routed; h itself, in its own shape, and `carry` (the
  residual stream) ride beside the rows through the exchanges, untouched, to `after`. h keeps its shape so that
  a gradient `after` sends it (shared experts on the block's (b, s, d) input) joins the routed rows' at the same
  tensor as in the ordinary forward: three gradients summed at the rows would round differently from two at
  each of the two;
- route(rows) -> (weights [T, k], indices [T, k]): the router;
- experts_fn(rows, counts): this rank's experts (dispatch.ExpertsFn);
- after(ctx, h, moe [T, d], *carry) -> the tuple the next sub-stage takes (the residual sum, a reshape);
- gather(rows, token) -> [T k, d] and combine(rows, back [T k, d], order, weights) -> [T, d], optional: each
  (token, expert) pair's row in expert order (`token` = order // k, sort_by_expert's `order`), and the weighted
  sum of each token's k expert outputs; by default index_select and dispatch.combine_pairs. A model whose
  ordinary dispatcher does them otherwise passes its own, so that both paths run the same ops: under autocast a
  bf16 index_add and an indexing's accumulate sum a token's k > 2 row gradients with different roundings.

The count exchange (a small all-to-all: each rank must learn how many rows it receives before the rows can go) is
a Handshake: launched asynchronously after the route compute and waited just before the dispatch, where the split
sizes are read to the host (the layer's one device-to-host read), so it travels under the other micro-batch's
compute like the row all-to-alls.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megazoo.parallel.expert.dispatch import (ExpertsFn, _inverse, _rank_major_to_expert_major, check_expert_split,
                                             combine_pairs, sort_by_expert, split_sizes)
from megazoo.parallel.pipeline.fb_overlap import Compute, Exchange, Handshake, Stage, Tensors
from megazoo.parallel.topology import group_size


def moe_sub_stages(name: str, before: Callable[[dict, Tensors], torch.Tensor | Tensors],
                   route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], experts_fn: ExpertsFn,
                   after: Callable[..., Tensors], num_experts: int, group=None, *,
                   gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   combine: Callable[..., torch.Tensor] | None = None) -> list[Stage]:
    ep = group_size(group)
    n = check_expert_split(num_experts, ep)

    def routed(ctx: dict, inputs: Tensors) -> Tensors:
        got = before(ctx, inputs)
        h, carry = (got, ()) if isinstance(got, torch.Tensor) else (got[0], tuple(got[1:]))
        rows = h.reshape(-1, h.shape[-1])  # h rides on in its own shape: see the module docstring
        weights, indices = route(rows)
        k = indices.shape[1]
        order, counts = sort_by_expert(indices, num_experts)
        ctx[name] = {"order": order, "counts": counts}
        token = order // k
        return (h, weights, rows.index_select(0, token) if gather is None else gather(rows, token), *carry)

    def exchange_counts(ctx: dict) -> Callable[[], None]:
        """Launch the per-expert counts' all-to-all (comms.exchange_counts, asynchronous); finish() waits and
        reads the split sizes."""
        mine = ctx[name]["counts"].contiguous()
        received = mine if group is None else torch.empty_like(mine)
        work = None if group is None else dist.all_to_all_single(received, mine, group=group, async_op=True)

        def finish() -> None:
            if work is not None:
                work.wait()
            send, recv = split_sizes(mine, received, ep)  # the layer's one device-to-host read
            ctx[name].update(send=send, recv=recv, local=received.view(ep, n).sum(0),
                             regroup=_rank_major_to_expert_major(received.view(ep, n), sum(recv)))
        return finish

    def experts(ctx: dict, inputs: Tensors) -> Tensors:
        h, weights, arrived, *carry = inputs
        regroup = ctx[name]["regroup"]
        computed = experts_fn(arrived.index_select(0, regroup), ctx[name]["local"])
        return (h, weights, computed.index_select(0, _inverse(regroup)), *carry)

    def combined(ctx: dict, inputs: Tensors) -> Tensors:
        h, weights, back, *carry = inputs
        order = ctx[name]["order"]
        moe = combine_pairs(back, order, weights) if combine is None else \
            combine(h.reshape(-1, h.shape[-1]), back, order, weights)
        return after(ctx, h, moe, *carry)

    return [Compute(f"{name}.route", routed),
            Handshake(f"{name}.counts", exchange_counts),
            Exchange(f"{name}.dispatch", 2, lambda ctx: (ctx[name]["recv"], ctx[name]["send"]), group),
            Compute(f"{name}.experts", experts),
            Exchange(f"{name}.combine", 2, lambda ctx: (ctx[name]["send"], ctx[name]["recv"]), group),
            Compute(f"{name}.combine", combined)]
