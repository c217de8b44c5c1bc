"""One MoE layer as fb_overlap.py's sub-stages: route | dispatch | experts | combine | after.

The same math as parallel/expert/dispatch.dispatch_combine (stable sort of the (token, expert) pairs by expert,
the count exchange and its one host read, the uneven all-to-all, the regroup to expert-major, the experts, and
back), cut at its two row all-to-alls so that each can travel while another micro-batch computes. A block
supplies what surrounds the experts:

- before(ctx, inputs) -> h [T, d], or (h, *carry): whatever precedes the MoE (attention, norms; the embedding on a
  first stage); `carry` (the residual stream) rides beside the rows through the exchanges, untouched;
- route(h) -> (weights [T, k], indices [T, k]): the router;
- experts_fn(rows, counts): this rank's experts (dispatch.ExpertsFn);
- after(ctx, h, moe [T, d], *carry) -> the tuple the next sub-stage takes (the residual sum, a reshape).

The count exchange stays inside the route compute (a small synchronous all-to-all: the splits must be known
before the rows can go), so only the row all-to-alls are overlapped.
"""

from __future__ import annotations

from typing import Callable

import torch

from megazoo.parallel.expert.comms import exchange_counts
from megazoo.parallel.expert.dispatch import (ExpertsFn, _inverse, _rank_major_to_expert_major, check_expert_split,
                                             combine_pairs, sort_by_expert, split_sizes)
from megazoo.parallel.pipeline.fb_overlap import Compute, Exchange, Tensors
from megazoo.parallel.topology import group_size


def moe_sub_stages(name: str, before: Callable[[dict, Tensors], torch.Tensor | Tensors],
                   route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], experts_fn: ExpertsFn,
                   after: Callable[..., Tensors], num_experts: int,
                   group=None) -> list[Compute | Exchange]:
    ep = group_size(group)
    n = check_expert_split(num_experts, ep)

    def routed(ctx: dict, inputs: Tensors) -> Tensors:
        got = before(ctx, inputs)
        h, carry = (got, ()) if isinstance(got, torch.Tensor) else (got[0], tuple(got[1:]))
        weights, indices = route(h)
        k = indices.shape[1]
        order, counts = sort_by_expert(indices, num_experts)
        received = exchange_counts(counts, group)
        send, recv = split_sizes(counts, received, ep)  # the layer's one device-to-host read
        received = received.view(ep, n)
        ctx[name] = {"order": order, "send": send, "recv": recv, "local": received.sum(0),
                     "regroup": _rank_major_to_expert_major(received, sum(recv))}
        return (h, weights, h.index_select(0, order // k), *carry)

    def experts(ctx: dict, inputs: Tensors) -> Tensors:
        h, weights, arrived, *carry = inputs
        regroup = ctx[name]["regroup"]
        computed = experts_fn(arrived.index_select(0, regroup), ctx[name]["local"])
        return (h, weights, computed.index_select(0, _inverse(regroup)), *carry)

    def combined(ctx: dict, inputs: Tensors) -> Tensors:
        h, weights, back, *carry = inputs
        return after(ctx, h, combine_pairs(back, ctx[name]["order"], weights), *carry)

    return [Compute(f"{name}.route", routed),
            Exchange(f"{name}.dispatch", 2, lambda ctx: (ctx[name]["recv"], ctx[name]["send"]), group),
            Compute(f"{name}.experts", experts),
            Exchange(f"{name}.combine", 2, lambda ctx: (ctx[name]["send"], ctx[name]["recv"]), group),
            Compute(f"{name}.combine", combined)]
