"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full vocabulary.

Each tensor-parallel rank holds logits for vocab ids [start, start + V/tp). Three all-reduces over the tp group
replace the gather: MAX of the row maxima (numerical stability), SUM of the target logit (only its owner
contributes), SUM of the exp-sums. Backward needs no communication: d loss / d logits = softmax - onehot, and each
rank already holds its own columns of both.

Columns at or beyond the true vocabulary size (padding to a multiple of 128 * tp) are masked to -inf, so the
padded model computes exactly the function of the unpadded one whatever tp is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazoo.parallel.collectives import all_reduce
from megazoo.parallel.topology import group_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index):
        local_vocab = logits.shape[-1]
        start = group_rank(group) * local_vocab
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)  # fp32 softmax (or fp64)
        valid_cols = vocab_size - start
        if valid_cols < local_vocab:
            logits[..., max(valid_cols, 0):] = float("-inf")

        row_max = logits.max(dim=-1).values
        all_reduce(row_max, group, dist.ReduceOp.MAX)
        logits.sub_(row_max.unsqueeze(-1))

        local_target = target - start
        not_here = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(not_here, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_here, 0.0)
        all_reduce(target_logit, group)

        probs = logits.exp_()
        sum_exp = probs.sum(dim=-1)
        all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, local_target, not_here | ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, local_target, not_here, ignored = ctx.saved_tensors
        grad = probs  # saved for this one use: update in place
        onehot_rows = (~not_here).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_rows.unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_size: int,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (same shape as `target`) from this rank's vocab shard of the logits.

    `vocab_size` is the true vocabulary size; logits of padding ids never receive probability. Tokens equal to
    `ignore_index` get loss 0 and no gradient.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, ignore_index)
