"""A stage's backward split in two: the input gradient (B) now, the weight gradients (W) later.

Zero-bubble schedules (Qi et al. 2024) send d loss / d input upstream as soon as possible and run the weight
gradients where the pipeline would otherwise idle. Both passes run torch's own autograd over the graph the
forward built; nothing is re-derived per layer type, so every op is covered alike (column/row-parallel linear,
vocab-parallel embedding, LayerNorm and the fused kernels, the tied head).

  B  `torch.autograd.grad(root, stage_input, grad, retain_graph=True)`: autograd runs only the nodes on paths to
     the stage input and, inside each node, only the outputs that path needs (a matmul's dX, not its dW). The
     tensor-parallel all-reduces of activation gradients run here. Before it, the graph is walked once to find
     the *weight nodes*: nodes on the input path with an edge into a parameter-only branch (a linear's addmm,
     a LayerNorm, an embedding's add); a pre-hook keeps the gradient arriving at each (its d output).
  W  For each weight node, `torch.autograd.grad` from its kept d output to its parameter-branch edges: autograd
     re-runs that one node computing only those outputs (the matmul's dW and db: the weight-gradient FLOPs, no
     activation gradient, no collective); then one `torch.autograd.backward` down every parameter branch into
     AccumulateGrad, exactly as an unsplit backward accumulates, so post-accumulate gradient hooks fire here, once
     per parameter (ZeRO 1-2 fill and reduce their buckets during W; ZeRO 1's in-place bucket views accumulate).

Two cases instead re-traverse the retained graph in W (`torch.autograd.backward(root, grad, inputs=params)`,
exact, but recomputing the activation gradients the weight gradients depend on: about one more B of compute and
tp all-reduces): activation checkpointing (a weight node's saved tensors are recomputed once per autograd call,
so one call per weight node would recompute each block many times; the re-traversal recomputes it once) and a
parameter branch reached from two weight nodes (a weight used twice in one stage: per-node passes would
double-count it). The first stage has no input gradient: its B is empty and its W the whole backward.

Memory held between B and W, per (micro-batch, chunk): the autograd graph of the stage's forward with its saved
activations (B frees nothing; with activation checkpointing the block inputs only), d output of every weight node
(about one more set of activation-sized tensors: what Megatron-LM's deferred weight gradient keeps too) and the
gradient arriving at the stage, (b, s, d); on the last stage d loss / d logits, (b, s, V/tp), instead (the loss's
backward runs once, in B). So a micro-batch's activations live from its F to its W: schedules count F..W.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class PendingWeightGradient:
    """What a B leaves for its W: the graph's root and the gradient at it, and (per-node W) every weight node
    with its parameter-branch edges and the d output B kept for it; `nodes` None: re-traverse the graph."""

    root: torch.Tensor | None
    grad: torch.Tensor | None
    nodes: list[tuple[Node, list[tuple[Node, int]]]] | None = None
    kept: dict = field(default_factory=dict)  # weight node -> its grad outputs, as B's pre-hook saw them


def _weight_nodes(root: torch.Tensor, stage_input: torch.Tensor) -> list[tuple[Node, list[tuple[Node, int]]]] | None:
    """Nodes on the input path with edges into parameter-only branches, with those edges; None when a branch is
    reached from two of them (re-traverse instead)."""
    start = root.grad_fn
    input_node = get_gradient_edge(stage_input).node
    order, parents, seen = [], {}, {start}
    stack = [start]
    while stack:  # every node, with how many parents it has (for a topological order)
        node = stack.pop()
        order.append(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child] = parents.get(child, 0) + 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    topo, ready, left = [], [start], dict(parents)
    while ready:  # Kahn: every node after all of its parents
        node = ready.pop()
        topo.append(node)
        for child, _ in node.next_functions:
            if child is not None:
                left[child] -= 1
                if left[child] == 0:
                    ready.append(child)
    on_input, to_param = set(), set()
    for node in reversed(topo):  # children first
        children = [c for c, _ in node.next_functions if c is not None]
        if node is input_node or any(c in on_input for c in children):
            on_input.add(node)
        elif getattr(node, "variable", None) is not None or any(c in to_param for c in children):
            to_param.add(node)  # a parameter's AccumulateGrad, or a node above one and off the input path
    nodes, claimed = [], set()
    for node in topo:
        if node not in on_input:
            continue
        edges = [(c, nr) for c, nr in node.next_functions if c is not None and c in to_param]
        if not edges:
            continue
        branch, stack = set(), [c for c, _ in edges]
        while stack:
            n = stack.pop()
            if n not in branch:
                branch.add(n)
                stack.extend(c for c, _ in n.next_functions if c is not None)
        if branch & claimed:
            return None
        claimed |= branch
        nodes.append((node, edges))
    return nodes


def backward_input(root: torch.Tensor, grad: torch.Tensor | None, stage_input: torch.Tensor | None,
                   logits: torch.Tensor | None = None,
                   recomputing: bool = False) -> tuple[torch.Tensor | None, PendingWeightGradient]:
    """B: d loss / d stage_input (None on the first stage, whose input is token ids: all its backward is W);
    the graph is kept for W. On the last stage (`root` the loss, `logits` what the loss read) the loss's own
    backward runs once, here: B and W then both start from d loss / d logits (cross-entropy kernels may consume
    their saved probabilities in backward, so it cannot run twice). `recomputing`: the stage uses activation
    checkpointing (W re-traverses the graph, see the module docstring)."""
    if logits is not None:
        (grad,) = torch.autograd.grad(root, logits, grad)
        root = logits
    if stage_input is None:
        return None, PendingWeightGradient(root, grad)
    nodes = None if recomputing else _weight_nodes(root, stage_input)
    pending = PendingWeightGradient(root, grad, nodes)
    hooks = [node.register_prehook(lambda outputs, node=node: pending.kept.__setitem__(node, outputs))
             for node, _ in nodes or ()]
    try:
        (dx,) = torch.autograd.grad(root, stage_input, grad, retain_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
    if nodes is not None:
        pending.root = pending.grad = None  # the weight nodes and their kept gradients hold what W needs
    return dx, pending


def backward_weight(pending: PendingWeightGradient, parameters: list[torch.nn.Parameter]) -> None:
    """W: accumulate every parameter gradient of the stage into .grad (hooks fire, once per parameter) and
    release the graph."""
    if pending.nodes is None:
        torch.autograd.backward(pending.root, pending.grad, inputs=[p for p in parameters if p.requires_grad])
        pending.root = pending.grad = None
        return
    edges, grads = [], []
    for node, branch in pending.nodes:
        outputs = [(GradientEdge(node, k), g) for k, g in enumerate(pending.kept.pop(node, ())) if g is not None]
        if not outputs:
            continue
        got = torch.autograd.grad([e for e, _ in outputs], [GradientEdge(c, nr) for c, nr in branch],
                                  [g for _, g in outputs], allow_unused=True)
        for (child, nr), g in zip(branch, got):
            if g is not None:
                edges.append(GradientEdge(child, nr))
                grads.append(g)
    if edges:
        torch.autograd.backward(edges, grads)  # down the parameter branches into AccumulateGrad (hooks)
    pending.nodes = None
