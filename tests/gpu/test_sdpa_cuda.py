"""torch's fused attention backends on the GPU (what kernels.attention = "torch" runs): FlashAttention-2 and the
memory-efficient kernel, causal, against the math backend, forward and backward; and their dropout.

Dropout is checked where its effect can be read exactly: with q = k = 0 every causal row i attends uniformly,
p_ij = 1 / (i + 1) for j <= i, and with v = the identity (hd = s) the output IS the dropped-out probability
matrix: out_ij = keep_ij / ((i + 1) (1 - p)). So the fraction of zeros in the causal triangle is the drop rate
(66,048 draws: its standard deviation at p = 0.2 is 0.0016, the test allows 0.01), every kept entry must equal
1 / ((i + 1) (1 - p)), and the same seed must give the same mask.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda", 0)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
BACKENDS = [pytest.param(SDPBackend.FLASH_ATTENTION, d, id=f"flash-{d}") for d in ("bf16", "fp16")] + \
           [pytest.param(SDPBackend.EFFICIENT_ATTENTION, d, id=f"efficient-{d}") for d in ("fp32", "bf16", "fp16")]


def randn(*shape, seed, dtype):
    return torch.randn(*shape, generator=torch.Generator(DEVICE).manual_seed(seed), device=DEVICE).to(dtype)


def attend(backend, q, k, v, dropout_p=0.0):
    with sdpa_kernel([backend]):  # only this backend: an unsupported case raises instead of falling back
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


@pytest.mark.parametrize("backend, dtype", BACKENDS)
@pytest.mark.parametrize("shape", [(2, 25, 256, 64), (2, 28, 256, 152)], ids=["gpt2-1.5b", "tnlg-17b"])
def test_fused_backend_equals_math_backend(backend, dtype, shape):
    dt = DTYPES[dtype]
    inputs = [randn(*shape, seed=s, dtype=dt) for s in (1, 2, 3)]
    dy = randn(*shape, seed=4, dtype=dt)
    results = {}
    for name, b in (("fused", backend), ("math", SDPBackend.MATH)):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        y = attend(b, q, k, v)
        y.backward(dy)
        results[name] = [y.detach(), q.grad, k.grad, v.grad]
    for what, got, ref in zip(("y", "dq", "dk", "dv"), results["fused"], results["math"]):
        assert got.dtype == dt and torch.isfinite(got).all(), what
        ref = ref.float()
        torch.testing.assert_close(got.float(), ref, rtol=TOL[dt], atol=TOL[dt] * ref.abs().max().item(),
                                   msg=lambda m: f"{backend.name} {dtype} {what}: {m}")


def _dropout_probe(backend, dt, p, seed, s=128, heads=4):
    """(b=2, heads, s, s) output for q = k = 0, v = I: the dropped-out causal attention probabilities."""
    q = torch.zeros(2, heads, s, s, device=DEVICE, dtype=dt)
    v = torch.eye(s, device=DEVICE, dtype=dt).expand(2, heads, s, s).contiguous()
    torch.manual_seed(seed)
    return attend(backend, q, q.clone(), v, dropout_p=p).float()


@pytest.mark.parametrize("backend, dtype", BACKENDS)
def test_dropout_rate_scaling_and_determinism(backend, dtype):
    dt, p, s = DTYPES[dtype], 0.2, 128
    out = _dropout_probe(backend, dt, p, seed=0)
    causal = torch.ones(s, s, dtype=torch.bool, device=DEVICE).tril()
    assert torch.all(out[..., ~causal] == 0), "dropout must not leak probability into the future"
    kept = out[..., causal] != 0
    rate = 1 - kept.float().mean().item()
    assert abs(rate - p) < 0.01, f"{backend.name} {dtype}: drop rate {rate:.4f}, asked for {p}"
    rows = torch.arange(s, device=DEVICE).view(s, 1).expand(s, s)[causal].float()
    expected = (1.0 / ((rows + 1) * (1 - p))).expand_as(kept)
    torch.testing.assert_close(out[..., causal][kept], expected[kept], rtol=TOL[dt] * 2, atol=0,
                               msg=lambda m: f"{backend.name} {dtype}: kept values are not p_ij / (1 - p): {m}")
    assert torch.equal(out, _dropout_probe(backend, dt, p, seed=0)), "same seed, different dropout mask"
    assert not torch.equal(out, _dropout_probe(backend, dt, p, seed=1)), "another seed, the same mask"
    no_dropout = _dropout_probe(backend, dt, 0.0, seed=0)
    assert torch.all(no_dropout[..., causal] > 0), "p = 0 must keep every causal entry"
