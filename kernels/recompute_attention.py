"""Causal attention that keeps only q, k, v (and the RNG state) for backward, and recomputes the rest there.

Megatron's "selective activation recomputation" of the attention core (Korthikanti et al. 2022, sec. 4.2): the
forward runs torch's scaled_dot_product_attention, drops its autograd graph at once and saves q, k, v and, when
dropout is on, the state of the generator the dropout draws from; backward restores that state, runs the same
SDPA call again, so it draws the *same* dropout mask, and differentiates it. Nothing of the (b, h, s, s) scores,
probabilities or dropout mask outlives the call, on any device - what FlashAttention keeps on a GPU (q, k, v,
the output and a log-sum-exp), less the output (the output projection keeps its own copy) and the log-sum-exp.

Exact, not approximate: the forward and the recomputation are one and the same SDPA call as the plain path's
(same inputs; same requires_grad flags and grad mode, which select SDPA's backend - torch's sdp_utils asks
both, e.g. FlashAttention is refused for training head dims > 192 on sm86/89, and another backend draws its
mask differently; same autocast state; same generator state), so the output and the mask are bit-identical to
the plain `torch` path's (kernels/attention.attention_sdpa) for the same seed, and the gradients are autograd's
through that call. tests/models/test_recompute_attention.py checks both against the plain path and against an explicit
masked softmax that draws the same mask (CPU SDPA's math path draws bernoulli(1 - p) over the probabilities'
shape; the test replays that draw), in fp64 to 1e-10; on CUDA, bit for bit against the plain path.

Cost: one more attention forward per backward (+1/3 of the attention FLOPs). The generator is the default one of
q's device: the CPU's, or CUDA's (q's GPU); the caller's tensor-parallel fork (parallel/tensor/random.py) sets it
before the call, so the state saved is the fork's and the replay happens inside a fork of its own
(torch.random.fork_rng), leaving every stream as backward found it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import megazoo.parallel.accelerator as accelerator


_rng_state = accelerator.rng_state  # the state of the generator a dropout on `device` draws from


@contextlib.contextmanager
def _replayed_rng(device: torch.device, state: torch.Tensor | None):
    """Inside: `device`'s generator at `state`. After: every generator back where it was (fork_rng)."""
    if state is None:  # no dropout: nothing is drawn
        yield
        return
    with accelerator.fork_rng(device):
        accelerator.set_rng_state(state, device)
        yield


def _autocast_state(device_type: str) -> dict:
    """The autocast state the forward ran under, for the recomputation (as torch.utils.checkpoint does)."""
    return {"device_type": device_type, "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type), "cache_enabled": torch.is_autocast_cache_enabled()}


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    # The plain path's call, argument for argument (kernels/attention.attention_sdpa): any difference could
    # select another backend, and another backend draws its dropout mask differently.
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def _leaves(tensors, needs_grad) -> list[torch.Tensor]:
    """Fresh leaves with the originals' requires_grad flags (SDPA's backend choice reads them)."""
    return [t.detach().requires_grad_(need) for t, need in zip(tensors, needs_grad)]


class _RecomputedAttention(torch.autograd.Function):
    """forward: SDPA, its graph dropped, saving q, k, v (+ RNG state); backward: the same SDPA again, same mask."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p):
        ctx.dropout_p = dropout_p
        ctx.device = q.device
        ctx.rng = _rng_state(q.device) if dropout_p > 0 else None  # before SDPA draws its mask
        ctx.autocast = _autocast_state(q.device.type)
        ctx.save_for_backward(q, k, v)  # views of the QKV projection's output: no new memory
        # Grad mode as the plain path has it (autograd turns it off in here); the graph built is freed on return,
        # so what it saved lives only inside this call.
        with torch.enable_grad():
            y = _sdpa(*_leaves((q, k, v), ctx.needs_input_grad[:3]), dropout_p)
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        inputs = _leaves(ctx.saved_tensors, ctx.needs_input_grad[:3])
        with _replayed_rng(ctx.device, ctx.rng), torch.enable_grad(), torch.autocast(**ctx.autocast):
            y = _sdpa(*inputs, ctx.dropout_p)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(y, wanted, dy))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None)


def attention_recompute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention, (b, h, s, hd) -> (b, h, s, hd), equal to attention_sdpa (same seed, same mask), that
    keeps only q, k, v (+ the RNG state) for backward. Without autograd (no_grad, or no input needs a gradient)
    it is SDPA itself."""
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        return _sdpa(q, k, v, dropout_p)
    return _RecomputedAttention.apply(q, k, v, dropout_p)


DETAIL = ("scaled_dot_product_attention(is_causal=True), its graph dropped and recomputed in backward with the "
          "same dropout mask: keeps q, k, v + RNG state (selective recomputation)")
