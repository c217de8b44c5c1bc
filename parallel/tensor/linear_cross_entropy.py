"""The head and the cross-entropy in one pass, chunk by chunk over tokens: the (tokens, V/tp) logits never exist.

    loss = sum_i w_i * CE(h_i W^T, y_i)        h (T, d) the head's input, W (V/tp, d) this rank's vocabulary shard

Liger's fused linear cross-entropy, vocabulary-parallel. The loss is a weighted sum over tokens with weights fixed
in forward (the model's mean: w_i = cp / count for kept tokens, 0 for ignored ones), so d loss / d logits of a
chunk is final as soon as the chunk's softmax is: forward computes the gradients chunk by chunk and drops the
chunk's logits, and backward only scales the two gradients it kept by d loss (a scalar). Per chunk of rows:

    z = h_c W^T (c, V/tp) in h's dtype; an fp32 (or fp64) copy for the softmax, padding ids masked to -inf
    tp: all-reduce MAX of the row maxima; all-reduce SUM of [sum exp(z - M), the target logit (its owner's)]
    d z = (softmax - onehot) * w, cast to h's dtype (what the unfused head's backward receives)
    dh_c = dz W (partial over the vocabulary: the tp region's entry sums it over tp in backward)
    dW  += dz^T h_c (accumulated in fp32 or fp64, cast to W's dtype once at the end)

Collectives: two all-reduces over the tp group per chunk in forward (parallel/tensor/cross_entropy.py runs the
same three over the whole batch at once); none in backward.

Memory: besides the chunk's temporaries (rows x V/tp, a few copies) forward keeps dh (T, d) and dW (V/tp, d) for
backward, in place of the logits (T, V/tp) and their fp32 copy: at Llama 3's 128,256 ids and d = 4096 the two are
equal at 4,096 tokens, and dW is a gradient the optimizer needs anyway. The price: each micro-batch alive between
forward and backward on the last stage (GPipe's m, 1F1B's one) holds its own dW. Zero-bubble schedules, whose B
asks autograd for input gradients only, would drop the head's weight gradient: recipes refuse the pair.

Without gradients (evaluation, or inputs that do not require them) only the loss is computed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazoo.parallel.collectives import all_reduce
from megazoo.parallel.topology import group_rank

# Rows of one chunk: about this many logits (fp32: 128 MiB) at a time, in multiples of 64 rows (matmul tiles).
CHUNK_ELEMENTS = 1 << 25


def chunk_rows_for(tokens: int, local_vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    rows = max(64, elements // max(1, local_vocab) // 64 * 64)
    return max(1, min(tokens, rows))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, token_weight, group, vocab_size, chunk_rows, shared, need_grad):
        tokens, local_vocab = h.shape[0], weight.shape[0]
        start = group_rank(group) * local_vocab
        n_valid = min(max(vocab_size - start, 0), local_vocab)  # ids past vocab_size are padding: no probability
        compute = torch.promote_types(h.dtype, torch.float32)
        local_target = target - start
        here = (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.masked_fill(~here, 0)
        token_weight = token_weight.to(compute)
        loss = torch.zeros((), dtype=compute, device=h.device)
        dh = torch.empty_like(h) if need_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=compute, device=h.device) if need_grad[1] else None
        # fp16: d z = w (softmax - onehot) with w = 1 / tokens is far below fp16's normal range (6e-5) at a
        # realistic vocabulary and token count; the plain head receives it times the loss scale (2^16 at first).
        # So dz, dh and dW are kept times S = 2^-floor(log2 max w) (|dz| <= 1), a power of two that backward
        # divides out exactly. bf16 has fp32's range: S = 1. A 0-dim tensor: no host sync.
        prescale = (torch.exp2(-torch.floor(torch.log2(token_weight.abs().max().clamp(min=2.0 ** -100))))
                    if h.dtype == torch.float16 else torch.ones((), dtype=compute, device=h.device))
        for lo in range(0, tokens, chunk_rows):
            rows = slice(lo, lo + chunk_rows)
            z = h[rows].matmul(weight.t()).to(compute)  # (c, V/tp); a copy in fp32 when h is 16-bit
            if n_valid < local_vocab:
                z[:, n_valid:] = float("-inf")
            row_max = z.max(dim=-1).values
            all_reduce(row_max, group, dist.ReduceOp.MAX)
            picked = z.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1).masked_fill(~here[rows], 0.0)
            z.sub_(row_max.unsqueeze(-1)).exp_()  # z is now exp(logit - M)
            sums = torch.stack([z.sum(dim=-1), picked])
            all_reduce(sums, group)
            lse = row_max + sums[0].log()
            w = token_weight[rows]
            loss += ((lse - sums[1]) * w).sum()
            if dh is None and dw is None:
                continue
            z.div_(sums[0].unsqueeze(-1))  # softmax
            z.scatter_add_(-1, local_target[rows].unsqueeze(-1), -here[rows].to(compute).unsqueeze(-1))
            dz = z.mul_((w * prescale).unsqueeze(-1)).to(h.dtype)  # the unfused head's backward's input, x S
            del z
            if dh is not None:
                dh[rows] = dz.matmul(weight)
            if dw is not None:
                if dw.dtype == dz.dtype:
                    # in place: no weight-sized temporary (addmm's out= form: FLOP counters see addmm_ as nothing)
                    torch.addmm(dw, dz.t(), h[rows], out=dw)
                else:  # a 16-bit product (one weight-sized temporary) added into the fp32 accumulator
                    dw.add_(dz.t().matmul(h[rows]))
        if dw is not None:
            dw = dw.to(weight.dtype)
        ctx.save_for_backward(*(t for t in (dh, dw) if t is not None))
        ctx.has, ctx.shared, ctx.prescale, ctx.rows = (dh is not None, dw is not None), shared, prescale, chunk_rows
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        saved = list(ctx.saved_tensors)
        dh = dw = None
        # saved for this one backward: scaled in place, so no second weight-sized gradient exists beside them
        factor = grad_loss.to(ctx.prescale.dtype) / ctx.prescale  # the loss scale: 2^16 is inf in fp16
        if ctx.has[0]:
            dh = _scale_(saved.pop(0), factor, ctx.rows)
        if ctx.has[1]:
            dw = _scale_(saved.pop(0), factor, ctx.rows)
            if ctx.shared is not None:  # a tied weight: the embedding's lookup adds its rows in place
                ctx.shared.grad, dw = dw, None
        return dh, dw, None, None, None, None, None, None, None


def _scale_(t: torch.Tensor, factor: torch.Tensor, rows: int) -> torch.Tensor:
    """t *= factor in place, computed in fp32 (or t's wider dtype) and rounded once; 16-bit tensors a block of
    `rows` rows at a time, so the fp32 temporary stays one block."""
    if t.element_size() >= 4:
        return t.mul_(factor.to(t.dtype))
    for lo in range(0, t.shape[0], rows):
        block = t[lo:lo + rows]
        block.copy_(block.float().mul_(factor))
    return t


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, token_weight: torch.Tensor,
                         group, vocab_size: int, *, chunk_rows: int | None = None, shared=None) -> torch.Tensor:
    """sum_i token_weight_i * CE(h_i W^T, target_i) over the vocabulary sharded on `group`, as a 0-dim tensor.

    h (..., d) already in the tp region (entered: its gradient is this rank's partial, summed over tp by the
    caller's region entry); weight (V/tp, d); target and token_weight shaped like h without d (ignored tokens
    need token_weight 0; any target id works for them). `shared`: a tied embedding's _TiedGradient (the head's
    weight gradient goes there, not to autograd). Under autocast the caller casts h and weight first."""
    d = h.shape[-1]
    h2, t = h.reshape(-1, d), target.reshape(-1)
    rows = chunk_rows or chunk_rows_for(h2.shape[0], weight.shape[0])
    need = (torch.is_grad_enabled() and h.requires_grad, torch.is_grad_enabled() and weight.requires_grad)
    return _LinearCrossEntropy.apply(h2, weight, t, token_weight.reshape(-1).detach(), group, vocab_size, rows,
                                     shared, need)
