"""The AdamW step on flat fp32 tensors (ZeRO's owned master chunks, their .grad the owned gradient chunks).

Every implementation is a factory fn(param_groups, *, lr, betas, eps, weight_decay) -> torch.optim.Optimizer, so
ZeRO keeps one interface whatever runs underneath (param_groups[i]["lr"] set per step, `.state` for memory
accounting, state_dict() for checkpoints: every one stores "step", "exp_avg", "exp_avg_sq" per tensor).

Order: apex FusedAdam (multi-tensor CUDA kernel, AdamW mode), torch's fused AdamW (one kernel for all tensors,
CUDA and, since torch 2.4, CPU), a multi-tensor path (ForeachAdamW: torch's foreach ops, no host read), and the
reference: torch's single-tensor AdamW written out as a plain loop (bit-identical to
torch.optim.AdamW(foreach=False)).
"""

from __future__ import annotations

import torch

from megazoo.kernels.availability import Candidate, HALF_AND_FLOAT, apex_missing


class ReferenceAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter), decoupled weight decay, bias-corrected moments; one tensor at a time."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # the same state layout as torch.optim.AdamW
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                step = state["step"].item()
                p.mul_(1 - lr * wd)  # decoupled weight decay, before the moment update (as torch)
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        return loss


def adamw_reference(params, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2) -> torch.optim.Optimizer:
    return ReferenceAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def adamw_torch_fused(params, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)


class ForeachAdamW(torch.optim.Optimizer):
    """AdamW as multi-tensor (foreach) ops, bias corrections included: no step count is read on the host.

    torch.optim.AdamW(foreach=True) reads every step counter with `.item()` (unless capturable, which torch
    allows on accelerators only): a host sync per step on a GPU, and in the dry run, whose fake tensors answer a
    host read with a placeholder 0, a division by 1 - beta1^0 = 0 (ZeroDivisionError). Here each counter lives
    with its parameter ("capturable": checkpoint loads and ensure_adam_state put it there) and 1 - beta^t is a
    tensor, computed in the parameter's dtype."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:  # the same state layout as torch.optim.AdamW
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device != p.device:  # a counter loaded on the host
                    state["step"] = state["step"].to(p.device)
            grads = [p.grad for p in params]
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1.0)
            torch._foreach_mul_(params, 1 - lr * wd)  # decoupled weight decay, before the moments (as torch)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            t = [s.to(p.dtype) for s, p in zip(steps, params)]
            correction1 = torch._foreach_pow(beta1, t)  # beta1^t, then 1 - beta1^t
            torch._foreach_neg_(correction1)
            torch._foreach_add_(correction1, 1.0)
            correction2_sqrt = torch._foreach_pow(beta2, t)
            torch._foreach_neg_(correction2_sqrt)
            torch._foreach_add_(correction2_sqrt, 1.0)
            torch._foreach_sqrt_(correction2_sqrt)
            denom = torch._foreach_sqrt(exp_avg_sqs)  # sqrt(v) / sqrt(1 - beta2^t) + eps
            torch._foreach_div_(denom, correction2_sqrt)
            torch._foreach_add_(denom, eps)
            # p += (-lr / (1 - beta1^t)) m / denom, written as m / (denom (1 - beta1^t) / -lr): no host scalar
            torch._foreach_div_(correction1, -lr)
            torch._foreach_mul_(denom, correction1)
            torch._foreach_addcdiv_(params, exp_avgs, denom)
        return loss


def adamw_foreach(params, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2) -> torch.optim.Optimizer:
    return ForeachAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _load_apex():
    from apex.optimizers import FusedAdam

    def adamw_apex(params, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        return FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True)

    return adamw_apex


def _fused_missing(device: torch.device) -> str | None:
    # torch's fused AdamW exists for CUDA (and MPS/XPU) and, since torch 2.4, CPU.
    supported = ("cuda", "cpu", "mps", "xpu")
    return None if device.type in supported else f"torch's fused AdamW does not run on {device.type}"


CANDIDATES = (
    Candidate("apex", _load_apex, "apex.optimizers.FusedAdam(adam_w_mode=True)", apex_missing("amp_C"),
              dtypes=HALF_AND_FLOAT),
    Candidate("torch", lambda: adamw_torch_fused, "torch.optim.AdamW(fused=True)", _fused_missing),
    Candidate("foreach", lambda: adamw_foreach, "kernels/optimizer.py ForeachAdamW (multi-tensor, no host read)"),
    Candidate("reference", lambda: adamw_reference, "kernels/optimizer.py ReferenceAdamW (a plain loop)"),
)
