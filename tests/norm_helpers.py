"""What the 16-bit norm tests share (tests/models/test_norms_autocast.py on CPU and fake CUDA,
tests/gpu/test_norms_autocast_cuda.py on a GPU): a 16-bit result against its fp64 reference at a stated relative
tolerance, and a block's forward and backward against the same block in fp64."""

import torch


def close(got, ref, tol, what):
    """`got` (any dtype) equals the fp64 `ref` to `tol`, relative to ref's largest magnitude."""
    assert torch.isfinite(got).all(), f"{what}: not finite"
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def assert_block_matches_fp64(block, ref, x, y, dy, tol):
    """`y = block(x)` was run and `y.backward(dy)` taken in 16 bit; `ref` is the same block in fp64 with the same
    (rounded) weights: output, input gradient and every parameter gradient agree to `tol`."""
    xr = x.detach().double().requires_grad_()
    yr = ref(xr)
    yr.backward(dy.double())
    close(y, yr.detach(), tol, "block y")
    close(x.grad, xr.grad, tol, "block dx")
    for (name, p), q in zip(block.named_parameters(), ref.parameters()):
        close(p.grad, q.grad, tol, f"block d{name}")
