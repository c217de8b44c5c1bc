"""Every kernel op x implementation x dtype on the GPU, forward and backward, at GPT-2 1.5B and T-NLG 17B
widths (hidden 1600 / 25 heads of 64 and hidden 4256 / 28 heads of 152, vocabulary 50,257 padded to 50,304;
batch 2 x 128 tokens so every case fits), against the op's reference in the same dtype on the same GPU.

Implementations come from the dispatch (kernels/dispatch.py): one that cannot run here (apex not installed, or
built without its CUDA extensions) is skipped with the reason the dispatch gives. Tolerances are scale-aware
(atol = tol x max |expected|): fp32 1e-4, bf16 2e-2, fp16 4e-3 - one or two roundings of the output dtype.
"""

import pytest
import torch

from megazoo.kernels import KernelChoice, KernelError, implementations, resolve_kernels
from megazoo.kernels.attention import attention_reference
from megazoo.kernels.bias_gelu import bias_gelu_reference
from megazoo.kernels.cross_entropy import cross_entropy_reference
from megazoo.kernels.layer_norm import layer_norm_reference
from megazoo.kernels.optimizer import adamw_reference
from megazoo.models.presets import get_preset

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda", 0)
PRESETS = ("gpt2-1.5b", "tnlg-17b")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
BATCH, SEQ = 2, 128


def cases(op: str, dtypes=tuple(DTYPES)):
    return [pytest.param(preset, impl, dtype, id=f"{preset}-{impl}-{dtype}")
            for preset in PRESETS for impl in implementations(op) if impl != "reference" for dtype in dtypes]


def kernel(op: str, impl: str):
    """The implementation through the dispatch; skipped with the dispatch's reason when it cannot run here."""
    try:
        return resolve_kernels(KernelChoice(overrides={op: impl}), DEVICE)[op].fn
    except KernelError as err:
        pytest.skip(str(err).splitlines()[0])


def randn(*shape, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, device=DEVICE)).to(dtype)


def run(fn, inputs, grad_out):
    """fn's output and the gradients of every input, for `grad_out`."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def assert_matches(got, expected, dtype, what):
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, reference {expected.dtype}"
    assert torch.isfinite(got).all(), f"{what}: not finite"
    expected = expected.float()
    torch.testing.assert_close(got.float(), expected, rtol=TOL[dtype], atol=TOL[dtype] * expected.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def compare(fn, ref, inputs, grad_out, dtype, what):
    out, grads = run(fn, inputs, grad_out)
    ref_out, ref_grads = run(ref, inputs, grad_out)
    assert_matches(out, ref_out, dtype, f"{what} forward")
    assert len(grads) == len(ref_grads)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_matches(g, r, dtype, f"{what} grad of input {i}")


@pytest.mark.parametrize("preset, impl, dtype", cases("layer_norm"))
def test_layer_norm(preset, impl, dtype):
    dt, d = DTYPES[dtype], get_preset(preset).d_model
    fn = kernel("layer_norm", impl)
    x = randn(BATCH, SEQ, d, seed=1, dtype=dt, scale=3.0) + 0.5  # an offset mean: the statistics subtract it
    w, b = 1 + randn(d, seed=2, dtype=dt, scale=0.3), randn(d, seed=3, dtype=dt)
    compare(lambda *a: fn(*a, 1e-5), lambda *a: layer_norm_reference(*a, 1e-5), (x, w, b),
            randn(BATCH, SEQ, d, seed=4, dtype=dt), dt, f"{impl} layer_norm {preset} {dtype}")


@pytest.mark.parametrize("preset, impl, dtype", cases("bias_gelu"))
def test_bias_gelu(preset, impl, dtype):
    dt, f = DTYPES[dtype], 4 * get_preset(preset).d_model
    fn = kernel("bias_gelu", impl)
    x, bias = randn(BATCH, SEQ, f, seed=11, dtype=dt, scale=4.0), randn(f, seed=12, dtype=dt)
    compare(fn, bias_gelu_reference, (x, bias), randn(BATCH, SEQ, f, seed=13, dtype=dt), dt,
            f"{impl} bias_gelu {preset} {dtype}")


@pytest.mark.parametrize("preset, impl, dtype", cases("attention"))
def test_attention(preset, impl, dtype):
    cfg, dt = get_preset(preset), DTYPES[dtype]
    shape = (BATCH, cfg.n_head, SEQ, cfg.d_model // cfg.n_head)  # (b, h, s, hd)
    fn = kernel("attention", impl)
    q, k, v = (randn(*shape, seed=s, dtype=dt) for s in (21, 22, 23))
    if impl == "apex" and dt == torch.float32:  # apex's fused softmax is half precision only: said, not hidden
        with pytest.raises(TypeError, match="fp16/bf16"):
            fn(q, k, v, 0.0)
        return
    compare(lambda *a: fn(*a, 0.0), lambda *a: attention_reference(*a, 0.0), (q, k, v),
            randn(*shape, seed=24, dtype=dt), dt, f"{impl} attention {preset} {dtype}")


@pytest.mark.parametrize("preset, impl, dtype", cases("cross_entropy"))
def test_cross_entropy(preset, impl, dtype):
    cfg, dt = get_preset(preset), DTYPES[dtype]
    vocab, padded = cfg.vocab_size, cfg.padded_vocab(1)
    fn = kernel("cross_entropy", impl)
    logits = randn(BATCH, SEQ, padded, seed=31, dtype=dt, scale=3.0)
    logits[..., vocab:] = 30.0  # padding columns would dominate the softmax if they were not masked
    target = torch.randint(0, vocab, (BATCH, SEQ), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(32))
    target[0, :4] = torch.tensor([vocab - 1, 0, -100, -100], device=DEVICE)
    weights = randn(BATCH, SEQ, seed=33, dtype=torch.float32)
    loss, (grad,) = run(lambda x: fn(x, target, None, vocab), (logits,), weights)
    ref_loss, (ref_grad,) = run(lambda x: cross_entropy_reference(x, target, None, vocab), (logits,), weights)
    what = f"{impl} cross_entropy {preset} {dtype}"
    assert loss.dtype == torch.float32 and grad.dtype == dt, what  # fp32 losses, gradient in the logits' dtype
    assert_matches(loss, ref_loss, torch.float32 if dt == torch.float32 else dt, f"{what} loss")
    assert_matches(grad, ref_grad, dt, f"{what} dlogits")
    assert torch.all(loss[0, 2:4] == 0) and torch.all(grad[0, 2:4] == 0), f"{what}: ignored targets"
    assert torch.all(grad[..., vocab:] == 0), f"{what}: padding columns got a gradient"


def _adamw_steps(make, sizes, steps=3):
    """ZeRO-like flat fp32 masters (one decayed, one not), a few steps with a changing lr."""
    masters = [randn(n, seed=40 + i, dtype=torch.float32) for i, n in enumerate(sizes)]
    opt = make([{"params": masters[:1], "weight_decay": 0.1}, {"params": masters[1:], "weight_decay": 0.0}],
               lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for step in range(steps):
        for i, m in enumerate(masters):
            m.grad = randn(m.numel(), seed=100 * step + i, dtype=torch.float32, scale=0.1)
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (step + 1) / steps
        opt.step()
    return masters, opt


@pytest.mark.parametrize("preset, impl, dtype", cases("adamw", dtypes=("fp32",)))  # masters are fp32 always
def test_adamw(preset, impl, dtype):
    d = get_preset(preset).d_model
    sizes = (4 * d * d + 7, 3 * d)  # an MLP matrix (+ an odd tail) and the biases of a block
    got, opt = _adamw_steps(kernel("adamw", impl), sizes)
    ref, ref_opt = _adamw_steps(adamw_reference, sizes)
    for g, r in zip(got, ref):
        assert g.device == DEVICE
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{impl} adamw {preset}: {m}")
    assert {k for s in opt.state.values() for k in s} == {k for s in ref_opt.state.values() for k in s}
    assert all(float(s["step"]) == 3 for s in opt.state.values())
