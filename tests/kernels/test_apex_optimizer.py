"""apex's FusedAdam behind every ZeRO stage, on CPU: an optimizer with apex's Python surface (the step count in
param_groups, zero_grad() without set_to_none) must train, checkpoint and resume exactly like torch's AdamW."""

from __future__ import annotations

import types

import pytest
import torch
from recipe_helpers import tiny_resolved

import megazoo.recipes.training.trainer as trainer_module
from megazoo.parallel.checkpoint.views import optimizer_steps
from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer


class ApexLikeFusedAdam(torch.optim.Optimizer):
    """AdamW with apex.optimizers.FusedAdam(adam_w_mode=True)'s bookkeeping: `group["step"]` counts updates
    (the state holds only the moments), and `zero_grad` takes no argument."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def zero_grad(self):  # noqa: D401 - apex's signature: no set_to_none
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            t, (b1, b2) = group["step"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v.sqrt() / (1 - b2 ** t) ** 0.5).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))


@pytest.fixture
def apex_like(monkeypatch):
    original = trainer_module.build_optimizer

    def build(res, topo, chunks, kernels):
        return original(res, topo, chunks, {**kernels, "adamw": types.SimpleNamespace(fn=ApexLikeFusedAdam)})

    monkeypatch.setattr(trainer_module, "build_optimizer", build)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_apex_like_optimizer_resumes_exactly(apex_like, tmp_path, stage):
    def recipe(run_dir, **ckpt):
        return tiny_resolved(train={"steps": 6}, zero={"stage": stage}, run={"dir": str(run_dir)},
                             checkpoint={"every": 3, **ckpt})

    straight = Trainer(recipe(tmp_path / "a"), Topology.solo())
    straight.fit()
    assert optimizer_steps(straight.zero.optimizer) == 6
    first = Trainer(recipe(tmp_path / "b"), Topology.solo())
    first.fit()  # saves at 3 and 6
    resumed = Trainer(recipe(tmp_path / "b"), Topology.solo())
    start = resumed.load_checkpoint(tmp_path / "b" / "checkpoints" / "step_00000003")
    assert start == 3 and optimizer_steps(resumed.zero.optimizer) == 3  # bias correction continues at step 4
    resumed.fit(start_step=start)
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
