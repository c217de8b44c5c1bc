"""The tied embedding's fused gradient on the GPU (parallel/tensor/layers.py): the head keeps its weight gradient
and the lookup adds its rows into it. Against plain autograd (F.linear + F.embedding) on the same CUDA model, in
fp64 (where cuBLAS and the index-add differ from autograd's kernels only by summation order) and in bf16
parameters (ZeRO stages 1-3 store them), where the gradient is compared at bf16's resolution; and the CUDA
allocator's peak during backward holds one vocabulary x dim gradient less than plain autograd's.
"""

import pytest
import torch

from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda", 0)
CFG = get_preset("gpt2-tiny").replace(n_layer=2, vocab_size=50000, d_model=256, n_head=4, dropout=0.0,
                                      attn_dropout=0.0)


def _run(tied_head: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    model = GPT(CFG, Topology.solo(DEVICE), device=DEVICE, dtype=dtype)
    init_weights(model, seed=0)
    model.wte.tied_head = tied_head
    ids = torch.randint(0, CFG.vocab_size, (2, 65), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    return {n: p.grad.float() for n, p in model.named_parameters()}, peak, model.wte.weight


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.bfloat16, 2e-2)])
def test_fused_tied_gradient_matches_autograd_on_cuda(dtype, tol):
    fused, fused_peak, weight = _run(True, dtype)
    plain, plain_peak, _ = _run(False, dtype)
    for name, ref in plain.items():
        torch.testing.assert_close(fused[name], ref, rtol=tol, atol=tol * ref.abs().max().item(), msg=name)
    one_gradient = weight.numel() * weight.element_size()
    assert plain_peak - fused_peak >= one_gradient
