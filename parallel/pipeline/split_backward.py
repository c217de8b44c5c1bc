"""A stage's backward split in two: the input gradient (B) now, the weight gradient (W) later.

Zero-bubble schedules (Qi et al. 2024) send d loss / d input upstream as soon as possible and run the weight
gradients where the pipeline would otherwise idle. Here B and W are two passes of torch's own autograd over the
same retained graph:

  B  `torch.autograd.grad(root, stage_input, grad, retain_graph=True)`: autograd runs only the nodes on paths to
     the stage input and, inside each node, only the outputs that path needs (a matmul's dX, not its dW), so B is
     the input-gradient half of the backward. Nothing accumulates into any parameter's .grad.
  W  `torch.autograd.backward(root, grad, inputs=parameters)`: every parameter gradient, accumulated into .grad
     by autograd's AccumulateGrad exactly as an unsplit backward would, so post-accumulate gradient hooks fire
     here (ZeRO 1-2 fill and reduce their buckets during W, and ZeRO 1's in-place bucket views accumulate).

Why this mechanism: it is exact by construction for every op (column/row-parallel linear, vocab-parallel
embedding, LayerNorm and fused kernels, the tied head, activation checkpointing's recomputation, tensor-parallel
collectives in backward): W is the same autograd computation as the unsplit backward, restricted to the
parameters, and needs no per-layer code. The price: W re-traverses the stage's graph, so it recomputes the
activation gradients its parameter gradients depend on (about one more B of compute), re-runs the tensor-parallel
all-reduces of those activation gradients (every tp rank runs the same W, in the same order) and, with activation
checkpointing, recomputes each checkpointed block's forward a second time. Layers that stash (input, d output)
and compute only dW later (Megatron-LM's and torchtitan's approach) would avoid that recomputation.

Memory held between B and W, per (micro-batch, chunk): the whole autograd graph of the stage's forward with its
saved activations (B runs with retain_graph=True and frees nothing; with activation checkpointing the block
inputs only), the root (stage output or scaled loss) and d loss / d output, (b, s, d). So a micro-batch's
activations live from its F to its W, not to its B: a schedule's activation memory counts F..W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingWeightGradient:
    """What a B leaves for its W: the graph's root and the gradient arriving at it (None: the root is the loss)."""

    root: torch.Tensor
    grad: torch.Tensor | None


def backward_input(root: torch.Tensor, grad: torch.Tensor | None, stage_input: torch.Tensor | None,
                   logits: torch.Tensor | None = None) -> tuple[torch.Tensor | None, PendingWeightGradient]:
    """B: d loss / d stage_input (None on the first stage, whose input is token ids: all its backward is W);
    the graph is kept for W. On the last stage (`root` the loss, `logits` what the loss read) the loss's own
    backward runs once, here: B and W then both start from d loss / d logits, (b, s, V/tp), held until W
    (cross-entropy kernels may consume their saved probabilities in their backward, so it cannot run twice)."""
    if logits is not None:
        (grad,) = torch.autograd.grad(root, logits, grad)
        root = logits
    if stage_input is None:
        return None, PendingWeightGradient(root, grad)
    (dx,) = torch.autograd.grad(root, stage_input, grad, retain_graph=True)
    return dx, PendingWeightGradient(root, grad)


def backward_weight(pending: PendingWeightGradient, parameters: list[torch.nn.Parameter]) -> None:
    """W: accumulate every parameter gradient of the stage into .grad (hooks fire) and free the graph."""
    params = [p for p in parameters if p.requires_grad]
    torch.autograd.backward(pending.root, pending.grad, inputs=params)
    pending.root = pending.grad = None
