"""What the parity tests share: one training run's record (losses, gradient norms, validation loss, full
parameters) and the one comparison every layout is held to against the single-process fp64 reference."""

from __future__ import annotations

import torch
from harness import run_distributed
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.trainer import Trainer

LOSS_RTOL = 1e-10
PARAM_ATOL = 1e-10


def train_run(res, topo):
    trainer = Trainer(res, topo)
    result = trainer.fit()
    return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
            "params": trainer.full_state_dict()}


def assert_same_training(got, ref):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-10, atol=0)
    assert abs(got["val"] - ref["val"]) <= LOSS_RTOL * abs(ref["val"])
    assert got["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=PARAM_ATOL, msg=name)


def zero_run(parallel: dict, train: dict, zero: dict, steps: int | None = None):
    res = tiny_resolved(parallel=parallel, train={**train, **({"steps": steps} if steps else {})}, zero=zero)

    def work():
        trainer = Trainer(res, Topology.build(res.recipe.parallel.dp, res.recipe.parallel.tp))
        result = trainer.fit()
        return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_loss,
                "params": trainer.full_state_dict(), "memory": trainer.zero.memory_bytes(),
                "full_grads": [g is not None for g in getattr(trainer.zero, "full_grads", [])]
                + [g is not None for u in getattr(trainer.zero, "units", []) for g in u.grad_flats],
                "n_params": sum(p.numel() for p in trainer.model.parameters())}

    return run_distributed(work, res.world_size)
