"""The router's statistics per MoE layer and the auxiliary losses pooled from them.

Load balancing (Switch Transformer eq. 4-6, as transformers' load_balancing_loss_func computes `aux_loss` for
Mixtral, Qwen2-MoE and Qwen3-MoE): over the N routed rows of all MoE layers together,

    aux = E * sum_e (C_e / N) * (P_e / N),    C_e = top-k assignments to expert e, P_e = sum of its probabilities

pooled over the layers before the product (transformers' choice; a per-layer mean would differ). Data
parallelism (dp x cp ranks, each its own tokens, gradients averaged): C_e and N count every rank's tokens (an
all-reduce, no gradient) while P_e stays this rank's, over its own rows; the ranks' mean of E sum_e (C_e / N)
(P_e,r / N_r) is then the whole batch's aux loss, and so is their mean gradient (as Megatron's global aux loss),
which keeps every data-parallel layout computing one process's function. C_e is a count (no
gradient); the gradient reaches the router through P_e. Each layer records (C, P, rows) in a RouterStats, so the
pooled loss needs no logits kept and a layout that splits the tokens (sequence parallelism) sums the statistics.

Router z-loss (ST-MoE, Zoph et al. 2022): mean over rows of logsumexp(logits)^2, pooled over layers the same way
(sum of squares over all layers' rows / N). Both are added to the training loss with their coefficients
(ModelConfig.moe_aux_loss_coef, moe_z_loss_coef) by the decoder's `loss`.

moe_aux_loss_scope = "layer" (pipeline stages, which see only their own layers): each layer's own losses, averaged
over the model's MoE layers, enter backward through `AuxLossScaler` on the layer's output (identity forward; in
backward the loss term gets gradient 1), so no stage needs another's statistics, as Megatron's MoEAuxLossAutoScaler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RouterStats:
    """One MoE layer's routing of one forward pass. counts/dropped carry no gradient."""

    counts: torch.Tensor  # (E,) int64: top-k assignments routed to each expert
    prob_sum: torch.Tensor  # (E,) router dtype: sum over rows of the softmax probabilities (with gradient)
    rows: int  # the rows (tokens) `counts` counts
    z_sum: torch.Tensor  # () sum over rows of logsumexp(logits)^2 (with gradient)
    dropped: torch.Tensor  # () int64: assignments dropped by the capacity factor
    local_rows: int = 0  # the rows prob_sum and z_sum sum over (0: rows)
    seq_aux: torch.Tensor | None = None  # () DeepSeek-V3's sequence-wise balance loss of this layer (sigmoid_bias)

    def __post_init__(self):
        self.local_rows = self.local_rows or self.rows

    @staticmethod
    def of(logits: torch.Tensor, counts: torch.Tensor, dropped: torch.Tensor) -> "RouterStats":
        """From the router's logits (T, E): the probabilities in the logits' dtype (fp64 in an fp64 run, as
        transformers' aux loss takes them; the routing itself scores in fp32)."""
        probs = torch.softmax(logits, dim=-1)
        return RouterStats(counts=counts, prob_sum=probs.sum(0), rows=probs.shape[0],
                           z_sum=torch.logsumexp(logits, dim=-1).pow(2).sum(), dropped=dropped)

    def reduced(self, ranks: int, reduce_counts, reduce_sums) -> "RouterStats":
        """The statistics summed over `ranks` ranks that split the tokens evenly (sequence parallelism):
        `reduce_counts` (no gradient) for the counts, `reduce_sums` for the differentiable sums (all-reduce forward,
        identity backward: every rank adds the same loss, and each rank's rows get their gradient from its own
        copy). No host read: the rows are the same on every rank."""
        return RouterStats(reduce_counts(self.counts), reduce_sums(self.prob_sum), self.rows * ranks,
                           reduce_sums(self.z_sum), reduce_counts(self.dropped))

    def counted_over(self, ranks: int, reduce_counts) -> "RouterStats":
        """The counts of `ranks` data-parallel ranks (dp x cp, each its own tokens, gradients averaged over them),
        the probabilities this rank's own: then the ranks' mean loss, and their mean gradient, are those of the
        whole batch's aux loss (module docstring), so every data-parallel layout trains one process's function."""
        return RouterStats(reduce_counts(self.counts), self.prob_sum, self.rows * ranks, self.z_sum,
                           reduce_counts(self.dropped), self.local_rows)


def load_balancing_loss(stats: list[RouterStats], n_experts: int) -> torch.Tensor:
    """transformers' aux_loss over the given layers (pooled: module docstring)."""
    rows, local = sum(s.rows for s in stats), sum(s.local_rows for s in stats)
    counts = sum(s.counts for s in stats).to(stats[0].prob_sum.dtype)
    probs = sum(s.prob_sum for s in stats)
    return n_experts * (counts / rows * (probs / local)).sum()


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, seqs: int, top_k: int,
                          reduce_counts=None, reduce_sums=None, ranks: int = 1) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (its eq. 17-20, without alpha), averaged over `seqs` sequences:
    per sequence of S tokens, sum_e f_e P_e with f_e = E / (K S) x (tokens choosing e) and P_e = mean over tokens
    of s_e / sum_j s_j (the sigmoid scores normalised per token; the gradient flows through P). `scores` (T, E)
    and `indices` (T, k) hold the sequences' rows in order; under sequence parallelism each of `ranks` tp ranks
    holds S / ranks of every sequence and `reduce_counts` / `reduce_sums` sum over them (as RouterStats.reduced)."""
    n_experts = scores.shape[-1]
    share = (scores / scores.sum(-1, keepdim=True)).view(seqs, -1, n_experts).sum(1)  # (b, E)
    chosen = torch.zeros_like(share, dtype=torch.int64).scatter_add_(
        1, indices.reshape(seqs, -1), torch.ones_like(indices).view(seqs, -1))  # (b, E), no gradient
    if ranks > 1:
        share, chosen = reduce_sums(share), reduce_counts(chosen)
    length = scores.shape[0] // seqs * ranks
    f = chosen.to(share.dtype) * (n_experts / (top_k * length))
    return (f * share / length).sum(-1).mean()


def z_loss(stats: list[RouterStats]) -> torch.Tensor:
    """Router z-loss, mean over every layer's rows of logsumexp(logits)^2."""
    return sum(s.z_sum for s in stats) / sum(s.local_rows for s in stats)


class AuxLossScaler(torch.autograd.Function):
    """y = x in forward; backward passes dy to x and gradient `scale` to `loss` (a scalar already weighted by its
    coefficient), so the loss is minimised without being added to the value the trainer backpropagates. `scale`
    is the factor the trainer backpropagates the main loss with (loss scale / micro-batches of the step: set on
    the block by the Trainer, recipes/training/moe_metrics.set_aux_grad_scale), so the injected gradient weighs as
    the loss added to the main loss would."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype, ctx.scale = loss.shape, loss.dtype, scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # torch.full, not ones x scale: no host-to-device copy of a Python number
        return grad, torch.full(ctx.loss_shape, ctx.scale, dtype=ctx.loss_dtype, device=grad.device), None


def layer_losses(stats: RouterStats, n_experts: int, aux_coef: float, z_coef: float, n_moe_layers: int) -> torch.Tensor:
    """One layer's weighted share of the "layer"-scope losses: (aux_coef x its load balancing + z_coef x its
    z-loss) / the model's MoE layers."""
    loss = aux_coef * load_balancing_loss([stats], n_experts)
    if z_coef:
        loss = loss + z_coef * z_loss([stats])
    return loss / n_moe_layers
