"""Vocab-parallel cross-entropy that never materialises fp32 logits for the whole batch.

Every implementation is fn(logits, target, group, vocab_size, ignore_index=-100) -> per-token loss, with the
logits this rank's vocabulary shard (..., V/tp) and the same contract as parallel/tensor/cross_entropy.py (the
reference): padding ids (>= vocab_size) get no probability, ignored targets get loss 0 and no gradient.

The reference promotes the whole (b, s, V/tp) shard to fp32 and keeps fp32 probabilities for backward: at GPT-2
1.5B shapes (16 x 1024 tokens, V = 50304) that is 3.3 GB on top of the bf16 logits. The fused versions keep
only three fp32 numbers per row:
    1. per row, over the local columns: max m_r, sum of exp(x - m_r), and the target logit if owned here
       (torch: chunks of rows promoted to fp32 one at a time; Triton: tiles in registers)
    2. tp combination (two all-reduces for the whole batch): M = MAX_r m_r, then one SUM of the stacked
       [sum_exp_r * exp(m_r - M), target_logit_r]; lse = M + log(sum_exp), loss = lse - target_logit
    3. backward recomputes the softmax from the saved logits and lse, chunk by chunk (or tile by tile), and
       writes (softmax - onehot) * dloss directly in the logits' dtype. No communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazoo.kernels.availability import Candidate, HALF_AND_FLOAT, triton_missing
from megazoo.parallel.collectives import all_reduce
from megazoo.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from megazoo.parallel.topology import group_rank

# Rows of one fp32 chunk in the torch implementation: about 2**24 elements (64 MiB) at a time.
CHUNK_ELEMENTS = 1 << 24


class TorchChunkedBackend:
    """Per-row statistics and gradient with torch ops, `chunk_rows` rows of fp32 at a time."""

    name = "torch"

    def __init__(self, chunk_rows: int | None = None):
        self.chunk_rows = chunk_rows

    def _chunks(self, logits: torch.Tensor):
        rows = self.chunk_rows or max(1, CHUNK_ELEMENTS // max(1, logits.shape[1]))
        compute = torch.promote_types(logits.dtype, torch.float32)
        for start in range(0, logits.shape[0], rows):
            yield slice(start, start + rows), logits[start:start + rows].to(compute, copy=True)  # never in place

    def local_stats(self, logits: torch.Tensor, local_target: torch.Tensor, n_valid: int):
        m = logits.shape[0]
        compute = torch.promote_types(logits.dtype, torch.float32)
        stats = torch.empty(3, m, dtype=compute, device=logits.device)
        here = local_target >= 0
        for rows, x in self._chunks(logits):
            x[:, n_valid:] = float("-inf")  # padding ids: never any probability
            row_max = x.max(dim=-1).values
            shift = row_max.masked_fill(row_max == float("-inf"), 0.0)  # a shard of padding only
            stats[0, rows] = row_max
            stats[1, rows] = (x - shift.unsqueeze(-1)).exp_().sum(dim=-1)
            picked = x.gather(-1, local_target[rows].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            stats[2, rows] = picked.masked_fill(~here[rows], 0.0)
        return stats[0], stats[1], stats[2]

    def grad(self, logits: torch.Tensor, local_target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
             n_valid: int) -> torch.Tensor:
        grad = torch.empty_like(logits)
        for rows, x in self._chunks(logits):
            p = x.sub_(lse[rows].unsqueeze(-1)).exp_()
            p[:, n_valid:] = 0.0
            target = local_target[rows]
            # -1 at the target column of rows whose target is in this shard, -0 elsewhere: no nonzero() (that
            # would wait for the GPU twice per chunk).
            minus_one = -(target >= 0).to(p.dtype).unsqueeze(-1)
            p.scatter_add_(-1, target.clamp(min=0).unsqueeze(-1), minus_one)
            grad[rows] = p.mul_(scale[rows].unsqueeze(-1))
        return grad


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, backend):
        local_vocab = logits.shape[-1]
        start = group_rank(group) * local_vocab
        n_valid = min(max(vocab_size - start, 0), local_vocab)
        x = logits.reshape(-1, local_vocab).contiguous()  # (rows, V/tp): a view for contiguous logits
        flat_target = target.reshape(-1)
        local_target = flat_target - start
        local_target = local_target.masked_fill((local_target < 0) | (local_target >= local_vocab), -1)

        row_max, sum_exp, target_logit = backend.local_stats(x, local_target, n_valid)
        global_max = all_reduce(row_max.clone(), group, dist.ReduceOp.MAX)
        # Rescale each rank's sum to the global max; a shard of padding only has row_max -inf and sum 0.
        sums = torch.stack([sum_exp * torch.exp(row_max - global_max), target_logit])
        all_reduce(sums, group)
        lse = global_max + sums[0].log()
        ignored = flat_target == ignore_index
        loss = (lse - sums[1]).masked_fill(ignored, 0.0)

        ctx.save_for_backward(x, local_target, lse, ignored)
        ctx.n_valid, ctx.backend, ctx.shape = n_valid, backend, logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x, local_target, lse, ignored = ctx.saved_tensors
        scale = (grad_loss.reshape(-1).to(lse.dtype)).masked_fill(ignored, 0.0)
        grad = ctx.backend.grad(x, local_target, lse, scale.contiguous(), ctx.n_valid)
        return grad.view(ctx.shape), None, None, None, None, None


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_size: int,
                                       ignore_index: int = -100, *, backend=None) -> torch.Tensor:
    """Per-token loss from this rank's vocab shard, with `backend` (default: torch, chunked) doing the per-row
    work. tp-correct: the reductions over the vocabulary run over `group`."""
    return _FusedVocabParallelCrossEntropy.apply(logits, target, group, vocab_size, ignore_index,
                                                 backend or TorchChunkedBackend())


def cross_entropy_torch(logits, target, group, vocab_size, ignore_index=-100, *, chunk_rows=None):
    return fused_vocab_parallel_cross_entropy(logits, target, group, vocab_size, ignore_index,
                                              backend=TorchChunkedBackend(chunk_rows))


def cross_entropy_reference(logits, target, group, vocab_size, ignore_index=-100):
    """parallel/tensor/cross_entropy.py: fp32 copy of the whole shard, fp32 probabilities saved."""
    return vocab_parallel_cross_entropy(logits, target, group, vocab_size, ignore_index)


def _load_triton():
    from megazoo.kernels.triton_cross_entropy import TritonBackend

    def cross_entropy_triton(logits, target, group, vocab_size, ignore_index=-100, *, block_v=None):
        return fused_vocab_parallel_cross_entropy(logits, target, group, vocab_size, ignore_index,
                                                  backend=TritonBackend(block_v))

    return cross_entropy_triton


CANDIDATES = (
    Candidate("triton", _load_triton, "kernels/triton_cross_entropy.py (online softmax in registers, "
              "grad in the logits' dtype)", triton_missing, dtypes=HALF_AND_FLOAT),
    Candidate("torch", lambda: cross_entropy_torch, f"chunked fp32 rows (~{CHUNK_ELEMENTS:,} elements per chunk), "
              "lse saved, grad recomputed per chunk"),
    Candidate("reference", lambda: cross_entropy_reference, "parallel/tensor/cross_entropy.py "
              "(fp32 copy of the whole shard)"),
)
