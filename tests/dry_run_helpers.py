"""What the dry-run tests share: the tiny recipe they run for real and on fake tensors (written per layout into a
tmp folder), and the whole-size check of a shipped recipe against the planner."""

from __future__ import annotations

import contextlib

import torch

from megazoo.recipes.dry_run.run import load, pipeline_depth_overrides, roles, run_role
from megazoo.recipes.dry_run.report import report

TINY = """
[model]
preset = "gpt2-tiny"
n_layer = 4
vocab_size = 300
dropout = 0.0
attn_dropout = 0.0
[parallel]
dp = {dp}
tp = {tp}
pp = {pp}
[zero]
stage = {stage}
reduce_bucket_size = 20000
[train]
steps = 1
micro_batch = 2
grad_accum = {grad_accum}
seq_len = 32
precision = "{precision}"
{extra}
[data]
source = "synthetic"
synthetic_tokens = 20000
[logging]
progress = false
[sample]
tokens = 0
[run]
dir = "{run_dir}"
"""


def tiny_dry_recipe(tmp_path, *, dp=2, tp=1, pp=1, stage=0, extra="", precision="fp32", grad_accum=2):
    path = tmp_path / f"tiny-{dp}-{tp}-{pp}-{stage}-{precision}-{grad_accum}.toml"
    path.write_text(TINY.format(dp=dp, tp=tp, pp=pp, stage=stage, extra=extra, precision=precision,
                                grad_accum=grad_accum, run_dir=tmp_path / "run"))
    return path


def check_whole_dry_run(name: str, sets: list[str] | None, gpu_gb: float) -> None:
    """Shipped recipe `name` dry-runs whole at its full world size (sets None: pipeline_depth_overrides): every
    role within 10% of the planner, FLOPs within 2% of the formula, ZeRO's dp bytes the paper's volume."""
    res = load(f"recipes/{name}.toml", sets or [])
    if sets is None:
        assert pipeline_depth_overrides(res)  # a pipeline recipe with more micro-batches than stages
        res = load(f"recipes/{name}.toml", pipeline_depth_overrides(res))
    par = res.recipe.parallel
    chosen = roles(res)
    assert sorted(r for role in chosen for r in role.ranks) == list(range(par.dp * par.tp * par.pp * par.cp))
    rep = report(res, [run_role(res, role) for role in chosen], gpu_gb, 0.0)
    assert rep["world_size"] == par.dp * par.tp * par.pp * par.cp and rep["fits"] is True
    for row in rep["roles"]:
        # the measured peak of every role within 10% of the planner's (the bar; all are within 6% today)
        assert abs(row["measured_peak_bytes"] - row["planned_peak_bytes"]) <= 0.10 * row["planned_peak_bytes"], row
        assert {c["group_size"] for c in row["collectives"]} >= {par.dp}
        assert abs(row["flops"] - row["formula_flops"]) <= 0.02 * row["formula_flops"]
        if par.dp > 1:  # ZeRO's dp traffic is the paper's volume for the stage (megazoo's stage 0: fp32 grads)
            factor = 2 if res.recipe.zero.stage == 0 else 1
            assert abs(row["dp_ring_bytes"] - factor * row["paper_dp_comm_bytes"]) <= \
                0.02 * factor * row["paper_dp_comm_bytes"], row
    assert torch.distributed.is_initialized() is False  # the fake world is gone again


@contextlib.contextmanager
def cpu_tensor_in_the_mlp():
    """A device bug: the MLP adds a bias made on the CPU (as `torch.zeros(d)` without device= would be)."""
    from megazoo.models.mlp import MLP

    forward = MLP.forward

    def buggy(self, x):
        return forward(self, x) + torch.zeros(x.shape[-1])

    MLP.forward = buggy
    try:
        yield
    finally:
        MLP.forward = forward
