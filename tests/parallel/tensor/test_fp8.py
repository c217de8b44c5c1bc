"""FP8 linears (parallel/tensor/fp8.py), emulated on CPU: quantization within float8's stated error, each of the three
matmuls within the error bound that follows from it, the emulation equal to torch._scaled_mm (the CUDA path's call),
and the FP8 GPT at tp = 2 (with and without sequence parallelism) computing the solo FP8 GPT's function."""

import pytest
import torch
from harness import run_distributed

from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.tensor import gather_full, named_shards
from megazoo.parallel.tensor.fp8 import E4M3, E5M2, enable_fp8, fp8_linear, quantize, scaled_matmul
from megazoo.parallel.topology import Topology

# unit roundoff (half an ulp at 1) and half the smallest subnormal, in the scaled domain
STATED = {E4M3: (2.0 ** -4, 2.0 ** -10), E5M2: (2.0 ** -3, 2.0 ** -17)}


def _data(seed, *shape, spread=True):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if spread:  # rows and columns of very different magnitudes: what rowwise scaling is for
        t = t * torch.logspace(-3, 2, shape[0], dtype=torch.float64).unsqueeze(-1)
    return t


def _error_bound(t, dtype, dim):
    """Elementwise bound on |dequantize(quantize(t)) - t|: u |t| + eta / scale."""
    _, scale = quantize(t, dtype, dim)
    u, eta = STATED[dtype]
    return u * t.abs() + eta / scale.double()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dim", [None, 0, 1], ids=["tensorwise", "rows0", "rows1"])
def test_quantize_within_the_stated_error(dtype, dim):
    t = _data(0, 64, 48)
    q, scale = quantize(t, dtype, dim)
    assert q.dtype == dtype and scale.dtype == torch.float32
    err = (q.double() / scale.double() - t).abs()
    assert torch.all(err <= _error_bound(t, dtype, dim) * (1 + 1e-6))
    assert err.max() > 0  # really rounded to 8 bits
    assert q.float().abs().max() <= torch.finfo(dtype).max


def _matmul_bound(a, da, b, db):
    return da @ b.abs() + a.abs() @ db + da @ db


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_within_the_bound_of_its_quantization(recipe):
    x = _data(1, 40, 32).float().requires_grad_()
    w = _data(2, 24, 32).float().requires_grad_()
    dy = _data(3, 40, 24).float()
    y = fp8_linear(x, w, None, recipe)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    rw, gdt = recipe == "rowwise", (E4M3 if recipe == "rowwise" else E5M2)
    x64, w64, g64 = x.detach().double(), w.detach().double(), dy.double()
    e = _error_bound
    checks = [  # (fp8 result, a, its error bound, b, its error bound): the exact result is a @ b
        (y, x64, e(x64, E4M3, 1 if rw else None), w64.t(), e(w64, E4M3, 1 if rw else None).t()),
        (dx, g64, e(g64, gdt, 1 if rw else None), w64, e(w64, E4M3, 0 if rw else None)),
        (dw, g64.t(), e(g64, gdt, 0 if rw else None).t(), x64, e(x64, E4M3, 0 if rw else None)),
    ]
    for got, a, da, b, db in checks:
        exact = a @ b
        err = (got.double() - exact).abs()
        fp32_sums = 1e-5 * (a.abs() @ b.abs())  # the fp32 accumulation and output rounding on top
        assert torch.all(err <= _matmul_bound(a, da, b, db) + fp32_sums)
        assert err.max() > 1e-4 * exact.abs().max()  # the matmul really ran on 8-bit operands


def test_rowwise_beats_tensorwise_on_rows_of_different_scale():
    x, w = _data(4, 40, 32).float(), _data(5, 24, 32, spread=False).float()
    exact = x.double() @ w.double().t()
    rel = {r: ((fp8_linear(x, w, None, r).double() - exact).abs().amax(1) / exact.abs().amax(1)).max().item()
           for r in ("tensorwise", "rowwise")}
    assert rel["rowwise"] < 0.2 * rel["tensorwise"], rel  # the small rows lose their digits per tensor


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_emulation_equals_torch_scaled_mm(rowwise):
    """torch._scaled_mm (the CUDA path) runs on CPU in torch 2.13: the two paths' numbers agree."""
    a, b = _data(6, 32, 48).float(), _data(7, 16, 48).float()
    qa, sa = quantize(a, E4M3, 1 if rowwise else None)
    qb, sb = quantize(b, E4M3, 1 if rowwise else None)
    sb = sb.t() if rowwise else sb
    out = torch.bfloat16 if rowwise else torch.float32
    emulated, real = (scaled_matmul(qa, sa, qb.t(), sb, out, emulate=e) for e in (True, False))
    torch.testing.assert_close(real.float(), emulated.float(), rtol=1e-2 if rowwise else 1e-5, atol=1e-4)


CFG = {"gpt2": get_preset("gpt2-tiny").replace(n_layer=2, vocab_size=300, dropout=0.0, attn_dropout=0.0),
       "llama": get_preset("llama-tiny").replace(n_layer=2, vocab_size=300, dropout=0.0, attn_dropout=0.0)}


def _fp8_step(topo, name, recipe, dtype=torch.float32):
    model = GPT(CFG[name], topo, fused_loss=True, dtype=dtype)
    init_weights(model, seed=0)
    fp8 = enable_fp8(model, recipe) if recipe else []
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    grads = {n: gather_full(p.grad, spec, topo.tp_group) for n, p, spec in named_shards(model)}
    for n in ("wte.weight", "lm_head.weight"):  # the padded vocabulary depends on tp: its real 300 rows
        if n in grads:
            grads[n] = grads[n][:300]
    return loss.detach(), grads, fp8


def test_only_attention_and_mlp_projections_run_fp8():
    _, _, names = _fp8_step(Topology.solo(), "llama", "tensorwise")
    assert names == [f"h.{i}.{p}" for i in range(2) for p in ("attn.c_q", "attn.c_kv", "attn.c_proj", "mlp.c_fc",
                                                              "mlp.c_proj")]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_gpt_tracks_full_precision(recipe):
    (l8, g8, _), (l32, g32, _) = (_fp8_step(Topology.solo(), "llama", r) for r in (recipe, None))
    assert abs(l8 - l32) < 0.01 * l32 and l8 != l32
    for n in g32:  # every gradient within FP8's few percent, none of them left untouched by it
        assert (g8[n] - g32[n]).norm() <= 0.15 * g32[n].norm(), n


def _tp2(name, recipe, sp):
    return _fp8_step(Topology.build(dp=1, tp=2, sequence_parallel=sp), name, recipe, torch.float64)[:2]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("name,sp", [("gpt2", False), ("llama", True)], ids=["gpt2-tp2", "llama-tp2-sp"])
def test_fp8_at_tp2_is_the_solo_fp8_function(recipe, name, sp):
    """In fp64 the only rounding left is FP8's own: with every scale the unsharded tensor's (amax all-reduced over
    tp) the tp = 2 model quantizes exactly the solo model's values. Local scales would miss by FP8's error."""
    solo_loss, solo_grads, _ = _fp8_step(Topology.solo(), name, recipe, torch.float64)
    loss, grads = run_distributed(_tp2, 2, name, recipe, sp)[0]
    assert abs(loss - solo_loss) <= 1e-10
    for n in solo_grads:
        assert (grads[n] - solo_grads[n]).abs().max() <= 1e-10, n


def test_compiled_blocks_run_the_same_fp8():
    """train.compile = "blocks" traces the FP8 autograd function (aot_eager here: the capture without codegen)."""
    from megazoo.recipes.training.model_setup import compile_blocks
    eager = _fp8_step(Topology.solo(), "llama", "rowwise")
    model = GPT(CFG["llama"], Topology.solo(), fused_loss=True)
    init_weights(model, seed=0)
    enable_fp8(model, "rowwise")
    compile_blocks([model], "blocks:aot_eager")
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    assert loss.item() == eager[0].item()
    torch.testing.assert_close(model.h["0"].mlp.c_fc.weight.grad, eager[1]["h.0.mlp.c_fc.weight"], rtol=0, atol=0)
