"""FP8 linears on torch._scaled_mm and the fused head + loss, on a CUDA GPU (FP8: sm_89+, else skipped with the reason).

* each FP8 recipe's _scaled_mm path equals the emulation the CPU suite holds against FP8's error bound (the same
  quantized operands, fp32 sums in a different order);
* a bf16 Llama-shaped model trains with each FP8 recipe within 3% of bf16's loss after 30 steps;
* the fused head + loss equals the plain path in fp64 on the GPU, and in bf16 its CUDA peak is below the plain one's
  at Llama 3's vocabulary.
"""

import pytest
import torch

from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.tensor.fp8 import E4M3, E5M2, enable_fp8, quantize, scaled_matmul
from megazoo.parallel.topology import Topology

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda", 0)


def _needs_fp8():
    if torch.cuda.get_device_capability(DEVICE) < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name(DEVICE)} has no FP8 tensor cores (needs compute capability 8.9+)")


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_scaled_mm_equals_the_emulation(rowwise):
    _needs_fp8()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    a = torch.randn(256, 512, device=DEVICE, generator=gen)
    b = torch.randn(384, 512, device=DEVICE, generator=gen)
    for da in (E4M3,) if rowwise else (E4M3, E5M2):
        qa, sa = quantize(a, da, 1 if rowwise else None)
        qb, sb = quantize(b, E4M3, 1 if rowwise else None)
        sb = sb.t() if rowwise else sb
        real, emulated = (scaled_matmul(qa, sa, qb.t(), sb, torch.bfloat16, emulate=e) for e in (False, True))
        torch.testing.assert_close(real.float(), emulated.float(), rtol=1e-2, atol=1e-2)


CFG = get_preset("llama-tiny").replace(n_layer=4, d_model=512, n_head=8, n_kv_head=4, d_ff=1536, vocab_size=4096,
                                       dropout=0.0, attn_dropout=0.0)


def _train(fp8: str | None, steps: int = 30) -> float:
    torch.manual_seed(0)
    model = GPT(CFG, Topology.solo(DEVICE), device=DEVICE, fused_loss=True)
    init_weights(model, seed=0)
    if fp8:
        enable_fp8(model, fp8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (steps, 8, 257), generator=gen).to(DEVICE) * 7 % CFG.vocab_size
    for ids in data:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_tracks_bf16(recipe):
    _needs_fp8()
    bf16, fp8 = _train(None), _train(recipe)
    assert abs(fp8 - bf16) <= 0.03 * bf16, (fp8, bf16)


def test_fused_loss_on_the_gpu():
    cfg = get_preset("llama-tiny").replace(n_layer=1, vocab_size=128256, dropout=0.0, attn_dropout=0.0)
    ids = torch.randint(0, cfg.vocab_size, (4, 513), generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def run(fused, dtype):
        model = GPT(cfg, Topology.solo(DEVICE), device=DEVICE, dtype=dtype, fused_loss=fused)
        init_weights(model, seed=0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(DEVICE)
        base = torch.cuda.memory_allocated(DEVICE)
        loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(DEVICE) - base
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, peak

    (lf, gf, _), (lp, gp, _) = run(True, torch.float64), run(False, torch.float64)
    assert abs(lf - lp) < 1e-10 and all((gf[n] - gp[n]).abs().max() < 1e-10 for n in gp)
    (_, _, fused_peak), (_, _, plain_peak) = run(True, torch.bfloat16), run(False, torch.bfloat16)
    assert fused_peak < plain_peak, (fused_peak, plain_peak)
