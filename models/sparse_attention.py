"""Block-sparse causal attention: DeepSpeed's sparsity patterns as block masks (`[model] attention = "sparse"`).

The sequence is cut into blocks of `sparse_block` tokens; a pattern says which key blocks each query block sees
(a boolean (n, n) block layout, lower-triangular: causal), and inside the diagonal block the usual token-level
causal mask applies. Patterns (DeepSpeed's sparse attention, unidirectional; l, g, r the ModelConfig counts):

- "fixed" (Sparse Transformer, Child et al. 2019): blocks are grouped in windows of l; a query block sees its own
  window up to itself, plus the last g blocks ("summary" blocks) of every earlier window.
- "bigbird" (Zaheer et al. 2020): a sliding window of l blocks (itself and l - 1 before), the first g blocks
  (global), and r random earlier blocks per query block (fixed by `sparse_seed`).
- "sliding_window" (Longformer's local attention): itself and the l - 1 blocks before.

Implementations, fn(q, k, v, dropout_p) -> y with (b, h, s, hd) tensors like kernels/attention.py:
- `block_sparse_attention`: gathers, for each query block, only the key/value blocks it sees and attends over
  them: scores are (b, h, s, K x block) with K the most blocks any query block sees, so memory and work grow
  linearly with s at a fixed pattern. Plain torch ops with autograd: runs anywhere (this is the CPU path).
- `flex_sparse_attention`: torch.nn.attention.flex_attention with a BlockMask built from the same layout
  (compiled on CUDA it skips empty blocks in a fused kernel). On CPU torch 2.13's flex_attention has no
  backward and compiles slowly, so training on CPU uses block_sparse_attention; tests check flex's forward.
- `masked_dense_attention`: the reference, dense scores with the pattern's token mask (O(s^2) memory).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from megazoo.models.config import SPARSE_PATTERNS

PATTERNS = SPARSE_PATTERNS  # stated in models/config.py, which checks a config without torch


def block_layout(pattern: str, num_blocks: int, local: int, global_: int = 0, random: int = 0,
                 seed: int = 0) -> torch.Tensor:
    """(num_blocks, num_blocks) bool: [i, j] true when query block i sees key block j (never j > i)."""
    i = torch.arange(num_blocks).unsqueeze(1)
    j = torch.arange(num_blocks).unsqueeze(0)
    causal = j <= i
    if pattern == "sliding_window":
        layout = causal & (i - j < local)
    elif pattern == "fixed":
        same_window = (i // local) == (j // local)
        summary = (j % local) >= local - global_  # the last g blocks of each window
        layout = causal & (same_window | summary)
    elif pattern == "bigbird":
        layout = causal & ((i - j < local) | (j < global_))
        g = torch.Generator().manual_seed(seed)
        for row in range(1, num_blocks):
            picks = torch.randperm(row, generator=g)[:random]  # r earlier blocks (fewer when fewer exist)
            layout[row, picks] = True
    else:
        raise ValueError(f"model.sparse_pattern = {pattern!r} is invalid; valid: {', '.join(PATTERNS)}")
    return layout


def token_mask(layout: torch.Tensor, block: int, s: int) -> torch.Tensor:
    """(s, s) bool: the block layout at token resolution, with the causal mask inside diagonal blocks."""
    expanded = layout.repeat_interleave(block, 0).repeat_interleave(block, 1)[:s, :s]
    return expanded & torch.ones(s, s, dtype=torch.bool).tril()


def masked_dense_attention(q, k, v, layout: torch.Tensor, block: int, dropout_p: float = 0.0) -> torch.Tensor:
    """The reference: dense scores, everything outside the pattern masked out (fp32 softmax at least)."""
    s = q.shape[2]
    scores = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~token_mask(layout, block, s).to(q.device), float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


def gather_plan(layout: torch.Tensor, block: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """For a block layout: (kv block index per query block, (n, K) padded with 0) and the token mask of the
    gathered scores ((n, block, K x block) bool)."""
    layout = layout.cpu()
    n = layout.shape[0]
    counts = layout.sum(1)
    width = int(counts.max())
    idx = torch.zeros(n, width, dtype=torch.long)
    valid = torch.zeros(n, width, dtype=torch.bool)
    for row in range(n):
        cols = layout[row].nonzero().flatten()
        idx[row, :len(cols)], valid[row, :len(cols)] = cols, True
    qpos = torch.arange(block).view(1, block, 1, 1)
    kpos = torch.arange(block).view(1, 1, 1, block)
    diagonal = (idx == torch.arange(n).unsqueeze(1)).view(n, 1, width, 1)
    allowed = valid.view(n, 1, width, 1) & (~diagonal | (kpos <= qpos))  # (n, block, K, block)
    return idx.to(device), allowed.reshape(n, block, width * block).to(device)


CHUNK_ROWS = 256  # query rows per step of the recomputing implementation: bounds its temporaries


def _chunk(block: int) -> int:
    return max(1, CHUNK_ROWS // block)  # query blocks per step


def _chunk_scores(q, k, v, idx, allowed, lo: int, hi: int):
    """Query blocks lo..hi-1: (their key and value blocks gathered (b, h, c, K x block, hd), masked scores)."""
    b, h, n, block, hd = q.shape
    width = idx.shape[1]
    kg = k[:, :, idx[lo:hi]].reshape(b, h, hi - lo, width * block, hd)  # each query block's key blocks
    vg = v[:, :, idx[lo:hi]].reshape(b, h, hi - lo, width * block, hd)
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q[:, :, lo:hi] @ kg.transpose(-2, -1)).to(dtype) / math.sqrt(hd)  # (b, h, c, block, K x block)
    return kg, vg, scores.masked_fill(~allowed[lo:hi], float("-inf"))


class _BlockSparse(torch.autograd.Function):
    """Saves q, k, v, the output and the rows' log-sum-exp only (flash-attention style) and recomputes each
    chunk's probabilities in backward, so the stored activations do not grow with the pattern's width."""

    @staticmethod
    def forward(ctx, q, k, v, idx, allowed):  # q, k, v: (b, h, n, block, hd)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32),
                                                    device=q.device)
        step = _chunk(q.shape[3])
        for lo in range(0, q.shape[2], step):
            hi = min(lo + step, q.shape[2])
            _, vg, scores = _chunk_scores(q, k, v, idx, allowed, lo, hi)
            lse[:, :, lo:hi] = scores.logsumexp(dim=-1)  # every row sees itself: finite
            out[:, :, lo:hi] = ((scores - lse[:, :, lo:hi].unsqueeze(-1)).exp().to(q.dtype) @ vg)
        ctx.save_for_backward(q, k, v, out, lse, idx, allowed)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, idx, allowed = ctx.saved_tensors
        b, h, n, block, hd = q.shape
        width, scale = idx.shape[1], 1.0 / math.sqrt(hd)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad.to(lse.dtype) * out.to(lse.dtype)).sum(-1, keepdim=True)  # rowsum(dO * O)
        for lo in range(0, n, _chunk(block)):
            hi = min(lo + _chunk(block), n)
            kg, vg, scores = _chunk_scores(q, k, v, idx, allowed, lo, hi)
            p = (scores - lse[:, :, lo:hi].unsqueeze(-1)).exp()  # (b, h, c, block, K x block); 0 where masked
            do = grad[:, :, lo:hi].to(p.dtype)
            ds = p * (do @ vg.transpose(-2, -1).to(p.dtype) - delta[:, :, lo:hi])
            dq[:, :, lo:hi] = ((ds @ kg.to(p.dtype)) * scale).to(q.dtype)
            # The gathered blocks' gradients go back to the blocks they came from (summed over query blocks).
            flat = idx[lo:hi].flatten()
            dk.index_add_(2, flat, ((ds.transpose(-2, -1) @ q[:, :, lo:hi].to(p.dtype)) * scale).to(k.dtype)
                          .reshape(b, h, (hi - lo) * width, block, hd))
            dv.index_add_(2, flat, (p.transpose(-2, -1) @ do).to(v.dtype).reshape(b, h, (hi - lo) * width, block, hd))
        return dq, dk, dv, None, None


def block_sparse_attention(q, k, v, layout: torch.Tensor, block: int, dropout_p: float = 0.0,
                           plan: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention over the pattern's blocks only: O(s x K x block) work instead of O(s^2), and (without dropout)
    O(s) stored activations. Any s: the sequence is padded to whole blocks (padded keys come after every real
    query, so causality hides them). `plan`: gather_plan(layout, block), when the caller keeps it."""
    b, h, s, hd = q.shape
    n = -(-s // block)
    if n * block != s:
        q, k, v = (F.pad(t, (0, 0, 0, n * block - s)) for t in (q, k, v))
    idx, allowed = plan if plan is not None else gather_plan(layout[:n, :n], block, q.device)
    qb, kb, vb = (t.reshape(b, h, n, block, hd) for t in (q, k, v))
    if dropout_p == 0:
        return _BlockSparse.apply(qb, kb, vb, idx, allowed).reshape(b, h, n * block, hd)[:, :, :s]
    # With dropout: plain autograd over the gathered blocks (stores the probabilities and the gathered K, V).
    kg, vg, scores = _chunk_scores(qb, kb, vb, idx, allowed, 0, n)
    probs = F.dropout(scores.softmax(dim=-1).to(q.dtype), dropout_p)
    return (probs @ vg).reshape(b, h, n * block, hd)[:, :, :s]


def flex_sparse_attention(q, k, v, layout: torch.Tensor, block: int, dropout_p: float = 0.0,
                          compiled: bool = False) -> torch.Tensor:
    """torch's FlexAttention with a BlockMask from the layout (no dropout: FlexAttention has none)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if dropout_p > 0:
        raise ValueError("FlexAttention has no attention dropout: set model.attn_dropout = 0")
    s = q.shape[2]
    lay = layout.to(q.device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & lay[q_idx // block, kv_idx // block]

    mask = create_block_mask(mask_mod, None, None, s, s, device=q.device, BLOCK_SIZE=block)
    fn = torch.compile(flex_attention) if compiled else flex_attention
    return fn(q, k, v, block_mask=mask)


class SparseAttention:
    """fn(q, k, v, dropout_p) -> y for a ModelConfig's pattern (sizes from its sparse_* fields)."""

    def __init__(self, pattern: str, block: int, local: int, global_: int, random: int, seed: int,
                 implementation: str = "gather"):
        self.pattern, self.block, self.local, self.global_, self.random, self.seed = \
            pattern, block, local, global_, random, seed
        self.implementation = implementation  # "gather" | "flex" | "dense" (the masked reference)

    @classmethod
    def from_config(cls, cfg, device: torch.device | None = None) -> "SparseAttention":
        # FlexAttention's fused kernel needs torch.compile and a backward: CUDA only (see the module docstring).
        implementation = "flex" if device is not None and device.type == "cuda" else "gather"
        return cls(cfg.sparse_pattern, cfg.sparse_block, cfg.sparse_local_blocks, cfg.sparse_global_blocks,
                   cfg.sparse_random_blocks, cfg.sparse_seed, implementation)

    def layout(self, s: int) -> torch.Tensor:
        return _layout(self.pattern, -(-s // self.block), self.local, self.global_, self.random, self.seed)

    def density(self, s: int) -> float:
        """Share of the causal triangle's token pairs the pattern keeps."""
        kept = token_mask(self.layout(s), self.block, s).sum().item()
        return kept / (s * (s + 1) / 2)

    def __call__(self, q, k, v, dropout_p: float = 0.0) -> torch.Tensor:
        layout = self.layout(q.shape[2])
        if self.implementation == "dense":
            return masked_dense_attention(q, k, v, layout, self.block, dropout_p)
        if self.implementation == "flex" and q.shape[2] % self.block == 0 and dropout_p == 0:
            return flex_sparse_attention(q, k, v, layout, self.block, compiled=True)
        plan = _plan(self.pattern, layout.shape[0], self.local, self.global_, self.random, self.seed, self.block,
                     q.device)
        return block_sparse_attention(q, k, v, layout, self.block, dropout_p, plan)


@functools.lru_cache(maxsize=64)
def _layout(pattern: str, n: int, local: int, global_: int, random: int, seed: int) -> torch.Tensor:
    return block_layout(pattern, n, local, global_, random, seed)


@functools.lru_cache(maxsize=64)
def _plan(pattern: str, n: int, local: int, global_: int, random: int, seed: int, block: int, device):
    return gather_plan(_layout(pattern, n, local, global_, random, seed), block, device)
