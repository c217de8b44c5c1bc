"""The MoE experts' grouped matmul on one GPU (torch._grouped_mm on CUDA, bf16 and fp32) equals the per-expert loop
forward and backward, with empty experts among them, and a whole MoE model's bf16 forward under autocast takes the
grouped path (the CPU suite holds the same on CPU: tests/models/moe/test_moe_block.py)."""

import pytest
import torch

from megazoo.models.moe.experts import expert_ffn, grouped_mm_unsupported
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_equals_loop_on_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, d, f = (64, 0, 128, 32, 0, 96, 16, 8), 256, 128
    assert grouped_mm_unsupported(dtype, d, f) is None
    results = {}
    for impl in ("grouped", "loop"):
        tokens = torch.randn(sum(rows), d, device="cuda", dtype=dtype, generator=g.manual_seed(1)).requires_grad_()
        w_fc = (torch.randn(8, 2 * f, d, device="cuda", dtype=dtype, generator=g) * 0.05).requires_grad_()
        w_proj = (torch.randn(8, d, f, device="cuda", dtype=dtype, generator=g) * 0.05).requires_grad_()
        y = expert_ffn(tokens, torch.tensor(rows, device="cuda"), w_fc, w_proj, impl)
        y.float().pow(2).sum().backward()
        results[impl] = [t.float() for t in (y, tokens.grad, w_fc.grad, w_proj.grad)]
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for got, ref in zip(results["grouped"], results["loop"], strict=True):
        assert (got - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_moe_model_trains_a_step_in_bf16_autocast():
    cfg = get_preset("qwen3-moe-tiny").replace(n_layer=2, vocab_size=512, moe_aux_loss_coef=0.01)
    model = GPT(cfg, Topology.solo(torch.device("cuda", 0)), device="cuda")
    init_weights(model, 0)
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model.loss(model(ids), ids)
    loss.backward()
    assert torch.isfinite(loss) and model.h["0"].mlp.experts.c_fc.weight.grad.abs().sum() > 0
