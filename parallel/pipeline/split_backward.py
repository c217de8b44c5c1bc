"""A stage's backward split in two: the input gradient (B) now, the weight gradients (W) later.

Zero-bubble schedules (Qi et al. 2024) send d loss / d input upstream as soon as possible and run the weight
gradients where the pipeline would otherwise idle. B releases the autograd graph; what W needs waits in a small
deferred weight-gradient store (`PendingWeightGradient`), as in Megatron-LM's zero-bubble fork and torchtitan:

  B  The graph is walked once to find the *weight nodes*: nodes on the input path with an edge into a
     parameter-only branch. Then one `torch.autograd.grad(root, [stage_input, *eager edges], grad)`, without
     retain_graph, so every saved activation the backward read is freed when it returns. The tensor-parallel
     all-reduces of activation gradients run here.
     - A linear's matmul (`addmm` / `mm` with the weight as its second operand, as F.linear records it) runs
       only its dX: its weight edge is not asked for. A pre-hook on the node stashes exactly what its dW needs:
       the saved input X (s x in, recomputed first under activation checkpointing) and the arriving dY
       (s x out). That is the store's bulk, and dW's FLOPs stay in W.
     - Every other parameter edge (a LayerNorm's or RMSNorm's weight and bias, a bias add, LoRA adapters, an
       unknown op) is an *eager edge*: B asks for its gradient and keeps the result, which autograd has already
       reduced to the parameter's shape (d elements for a norm or a bias: what a norm's dW costs is negligible
       beside the matmuls'). Their gradients come from torch's own backward of each op: nothing re-derived.
       The head's matmul on the last stage is eager too when its weight (V/tp x d) is smaller than its X and
       d logits (tokens x (d + V/tp)), as at every realistic token count: d logits are the last stage's
       largest tensor, and keeping them for each micro-batch waiting for W would double the last stage's
       activations (gpt2-117m at pp 4: 4.2 GB against 1F1B's 2.0). That dW's FLOPs then run in B.
  W  dW = X^T dY per stashed matmul (in autograd's own operand order, so the bits match), then one
     `torch.autograd.backward` from every weight edge and eager edge with its gradient, down the parameter
     branches (transpose, autocast's cast, tensor/sequence-parallel `replicated`: its tp all-reduce runs here)
     into AccumulateGrad. A parameter reached twice is summed before its AccumulateGrad runs, exactly as in an
     unsplit backward, so post-accumulate gradient hooks fire here once per parameter (ZeRO 1-2 fill and reduce
     their buckets during W; ZeRO 1's in-place bucket views accumulate).

Three cases keep the graph instead (B `retain_graph=True`, W `torch.autograd.backward(root, grad, inputs=params)`:
exact, but W re-traverses the graph, recomputing the activation gradients its weight gradients depend on):
- the first stage, whose input is token ids (no input gradient: B is empty and W the whole backward);
- activation checkpointing (`recomputing`): torch's non-reentrant checkpoint hands each recomputed tensor out
  once per backward call, to the node that saved it, so B cannot read a linear's X for the store as well. The
  graph then holds the blocks' inputs only (what checkpointing keeps anyway), and W recomputes each block once;
- a stage where one parameter-branch edge lies inside another's branch (a weight reached through two routes of
  different depth: asking for both in B would count it twice).

Memory held between B and W, per (micro-batch, chunk): X and dY of every linear (per GPT block at tp t, in
activation elements per token: 4 d of inputs and 12 d / t of output gradients; a sequence-parallel projection
that gathers its input inside its own backward, parallel/tensor/sequence.py, is an eager edge: its weight
gradient), the eager edges' parameter-shaped gradients (d per norm and bias), nothing of attention, GELU,
dropout or the residual stream. On the last stage the head's weight gradient (V/tp x d), or, at very few tokens,
its X and d logits. The first stage, and a stage under checkpointing, hold their graph from F to W.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

# matmul nodes whose weight gradient W computes from the stash: node name -> (the weight's operand index in
# next_functions, the saved input that multiplies dY)
_MATMULS = {"AddmmBackward0": (2, "_saved_mat1"), "MmBackward0": (1, "_saved_self")}


def _deferrable(node: Node) -> tuple[int | None, str | None]:
    """(weight operand index, saved input) of a matmul W can compute as X^T dY; (None, None) otherwise (an
    addmm with alpha != 1 is not F.linear's)."""
    operand, saved_input = _MATMULS.get(node.name(), (None, None))
    if operand is not None and getattr(node, "_saved_alpha", 1) != 1:
        return None, None
    return operand, saved_input


def _column_major(node: Node) -> bool:
    """mat2 (W^T as F.linear records it) laid out column-major: aten's mm_mat2_backward then computes
    (dY^T X)^T, and W does the same so the bits match."""
    sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
    return strides[0] == 1 and strides[1] == sizes[0]


@dataclass
class DeferredMatmul:
    """One linear's weight gradient, waiting for W: the weight operand's edge (mat2 = W^T), the saved input and
    the output gradient (both 2-D), and whether mat2 is column-major (autograd then computes (dY^T X)^T)."""

    edge: GradientEdge
    x: torch.Tensor
    dy: torch.Tensor
    transposed: bool

    def grad(self) -> torch.Tensor:  # d loss / d mat2, (in, out): aten's mm_mat2_backward
        return self.dy.t().mm(self.x).t() if self.transposed else self.x.t().mm(self.dy)


@dataclass
class PendingWeightGradient:
    """What a B leaves for its W: per group of parameters (`groups`), its edges each with the gradient B computed
    (an eager edge) or the stashed matmul W computes it from; or, when the graph is kept (first stage,
    checkpointing, nested branches), its root and the gradient at it. Edges reaching a common parameter share
    a group, so W accumulates each parameter once."""

    root: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    groups: list[list[tuple[GradientEdge, torch.Tensor | DeferredMatmul | None]]] = field(default_factory=list)

    @property
    def matmuls(self) -> list[DeferredMatmul]:
        return [v for group in self.groups for _, v in group if isinstance(v, DeferredMatmul)]

    @property
    def grads(self) -> list[torch.Tensor]:  # the eager edges' gradients
        return [v for group in self.groups for _, v in group if isinstance(v, torch.Tensor)]

    def held_tensors(self) -> list[torch.Tensor]:
        """What the store keeps alive (for memory accounting): stashed inputs, output gradients, eager grads."""
        return [t for m in self.matmuls for t in (m.x, m.dy)] + self.grads


def _parameter_groups(edges: list[GradientEdge]) -> list[list[int]]:
    """Indices of `edges`, grouped so that edges whose branches reach a common parameter (AccumulateGrad)
    share a group; groups in the order of their first edge."""
    groups: list[tuple[set, list[int]]] = []
    for i, edge in enumerate(edges):
        leaves, seen, stack = set(), set(), [edge.node]
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                if getattr(node, "variable", None) is not None:
                    leaves.add(node)
                stack.extend(c for c, _ in node.next_functions if c is not None)
        joined, rest = (leaves, [i]), []
        for group in groups:
            if group[0] & joined[0]:
                joined = (group[0] | joined[0], group[1] + joined[1])
            else:
                rest.append(group)
        groups = rest + [joined]
    return sorted((sorted(members) for _, members in groups), key=lambda members: members[0])


def _topological(start: Node) -> list[Node]:
    """Every node under `start`, each after all of its parents (Kahn's order)."""
    parents, seen, stack = {}, {start}, [start]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child] = parents.get(child, 0) + 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    topo, ready, left = [], [start], dict(parents)
    while ready:
        node = ready.pop()
        topo.append(node)
        for child, _ in node.next_functions:
            if child is not None:
                left[child] -= 1
                if left[child] == 0:
                    ready.append(child)
    return topo


def _weight_nodes(root: torch.Tensor, stage_inputs: list[torch.Tensor]) -> list[tuple[Node, list[int]]] | None:
    """Nodes on the inputs' paths with edges into parameter-only branches, with those edges' indices; None when
    one such edge's node lies inside another's branch (keep the graph instead)."""
    topo = _topological(root.grad_fn)
    input_nodes = {get_gradient_edge(x).node for x in stage_inputs}
    on_input, to_param = set(), set()
    for node in reversed(topo):  # children first
        children = [c for c, _ in node.next_functions if c is not None]
        if node in input_nodes or any(c in on_input for c in children):
            on_input.add(node)
        elif getattr(node, "variable", None) is not None or any(c in to_param for c in children):
            to_param.add(node)  # a parameter's AccumulateGrad, or a node above one and off the input path
    nodes, heads = [], set()
    for node in topo:
        if node in on_input:
            found = [i for i, (c, _) in enumerate(node.next_functions) if c is not None and c in to_param]
            if found:
                nodes.append((node, found))
                heads.update(node.next_functions[i][0] for i in found)
    for head in heads:  # a branch head below another head: its gradient would arrive there twice
        stack = [c for c, _ in head.next_functions if c is not None]
        seen = set()
        while stack:
            n = stack.pop()
            if n in heads:
                return None
            if n not in seen:
                seen.add(n)
                stack.extend(c for c, _ in n.next_functions if c is not None)
    return nodes


def _head_matmul(logits: torch.Tensor) -> Node | None:
    """The matmul that produced the logits, when W's inputs (X and d logits, tokens x (d + V)) would outweigh
    its weight gradient (V x d): B then computes that gradient (an eager edge), so a micro-batch waiting for W
    keeps no d logits - the last stage's largest tensor, which 1F1B frees at B."""
    node = logits.grad_fn
    while node is not None and node.name() in ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"):
        node = node.next_functions[0][0]
    if node is None or _deferrable(node)[0] is None:
        return None
    d, vocab = node._saved_mat2_sym_sizes
    tokens = logits.numel() // logits.shape[-1]
    return node if d * vocab < tokens * (d + vocab) else None


def backward_input(root: torch.Tensor, grad: torch.Tensor | None,
                   stage_input: torch.Tensor | list[torch.Tensor] | None, logits: torch.Tensor | None = None,
                   recomputing: bool = False) -> tuple[torch.Tensor | list | None, PendingWeightGradient]:
    """B: d loss / d stage_input (None on the first stage, whose input is token ids: all its backward is W),
    the graph released and W's inputs stashed (module docstring). On the last stage (`root` the loss, `logits`
    what the loss read) the loss's own backward runs once, here: cross-entropy kernels may consume their saved
    probabilities in backward, so it cannot run twice. `recomputing`: the stage uses activation checkpointing
    (the graph is kept, module docstring). A list of stage inputs (the forward/backward overlap's sub-stages,
    fb_overlap.py) gives the list of their gradients."""
    if logits is not None:
        (grad,) = torch.autograd.grad(root, logits, grad)
        root = logits
    several = isinstance(stage_input, (list, tuple))
    inputs = list(stage_input) if several else ([] if stage_input is None else [stage_input])
    nodes = None if not inputs or recomputing else _weight_nodes(root, inputs)
    if nodes is None:  # keep the graph: W is the whole backward (first stage) or re-traverses it
        got = list(torch.autograd.grad(root, inputs, grad, retain_graph=True, allow_unused=True)) if inputs else []
        return (got if several else (got[0] if got else None)), PendingWeightGradient(root, grad)
    edges, values, hooks, eager = [], [], [], []  # per parameter edge: its gradient source, filled below
    head = None if logits is None else _head_matmul(logits)
    for node, found in nodes:
        operand, saved_input = _deferrable(node) if node is not head else (None, None)
        for i in found:
            edge = GradientEdge(*node.next_functions[i])
            if i != operand and edge in edges:  # one edge reached from two nodes: B's gradient there is the sum
                continue
            edges.append(edge)
            values.append(None)
            if i != operand:
                eager.append(len(edges) - 1)
            else:
                def stash(outputs, node=node, slot=len(edges) - 1, saved_input=saved_input):
                    if outputs[0] is not None:  # X read here (recomputed first under activation checkpointing)
                        x = getattr(node, saved_input).detach()  # detached: the store holds no graph
                        values[slot] = DeferredMatmul(edges[slot], x, outputs[0].detach(), _column_major(node))

                hooks.append(node.register_prehook(stash))
    try:
        got = torch.autograd.grad(root, [*inputs, *(edges[k] for k in eager)], grad, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    for k, g in zip(eager, got[len(inputs):]):
        values[k] = g
    groups = [[(edges[k], values[k]) for k in members] for members in _parameter_groups(edges)]
    dx = list(got[:len(inputs)])
    return (dx if several else dx[0]), PendingWeightGradient(groups=groups)


def backward_weight(pending: PendingWeightGradient, parameters: list[torch.nn.Parameter]) -> None:
    """W: accumulate every parameter gradient of the stage into .grad (hooks fire, once per parameter) and
    empty the store."""
    if pending.root is not None:
        torch.autograd.backward(pending.root, pending.grad, inputs=[p for p in parameters if p.requires_grad])
        pending.root = pending.grad = None
        return
    while pending.groups:  # a group at a time: W's temporaries are one group's weight gradients
        total: dict[tuple[Node, int], torch.Tensor] = {}
        for edge, value in pending.groups.pop(0):
            g = value.grad() if isinstance(value, DeferredMatmul) else value
            if g is not None:  # a weight read twice (two matmuls, or a matmul and an eager edge): summed here
                key = (edge.node, edge.output_nr)
                total[key] = g if key not in total else total[key] + g
        if total:
            torch.autograd.backward([GradientEdge(*k) for k in total], list(total.values()))
