"""The planner follows train.fused_loss: a recipe whose logits dominate (vocabulary 16,384, 256 tokens, d = 128) is
dry-run with the head + loss fused and plain; the fused step's measured peak (torch's MemTracker on the real step)
is within 10% of the planner's for it, and well below the plain step's. (The plain step at this shape measures
14% (fp32) and 8% (bf16) above the planner's plain term: its logits-side accounting, not the fused one's.)"""

from __future__ import annotations

import pytest
from dry_run_helpers import tiny_dry_recipe

from megazoo.recipes.dry_run.report import report
from megazoo.recipes.dry_run.run import load, roles, run_role


def _rows(tmp_path, mode, precision, tp=1):
    folder = tmp_path / f"{mode}-{precision}-{tp}"
    folder.mkdir()
    path = tiny_dry_recipe(folder, dp=1, tp=tp, stage=1, precision=precision, grad_accum=1,
                           extra=f'fused_loss = "{mode}"\nmicro_batch = 8')
    path.write_text(path.read_text().replace("vocab_size = 300", "vocab_size = 16384")
                    .replace("micro_batch = 2\n", ""))
    res = load(path)
    assert res.fused_loss == (mode == "on")
    return report(res, [run_role(res, role) for role in roles(res)], 80, 0.0)["roles"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planner_follows_the_fused_loss(tmp_path, precision):
    (fused,), (plain,) = (_rows(tmp_path, mode, precision) for mode in ("on", "off"))
    measured, planned = fused["measured_peak_bytes"], fused["planned_peak_bytes"]
    assert abs(measured - planned) <= 0.10 * planned, (measured, planned)
    # measured: fp32 92.6 MB fused vs 117.5 plain; bf16 96.5 vs 104.8 (there dW's fp32 accumulator is transient)
    assert measured < (0.85 if precision == "fp32" else 0.95) * plain["measured_peak_bytes"]


# The 405B recipe's layout shrunk (tp 8 and sequence parallelism, ZeRO-2, activation checkpointing, 1F1B, its
# 128,256-word vocabulary) to a step of seconds: the same moments as its last stage, whose peak is the fused loss's
# forward (the whole recipe's, 16 layers: 3.707 GB measured, planned 4.30 before and 3.76 now).
SHRUNK_405B = ["model.n_layer=4", "model.d_model=2048", "model.n_head=16", "model.n_kv_head=8", "model.d_ff=5504",
               "parallel.pp=2", "parallel.dp=2", "train.grad_accum=2", "train.global_batch=4", "train.seq_len=2048",
               "train.fused_loss=on"]


def test_the_405b_layouts_fused_last_stage_is_planned_within_5_percent():
    """Measured 0.8326 GB against 0.9411 planned before (-11.5%): the plan put the 16-bit dW product beside the
    fp32 chunk (they never meet), counted a block recomputed during the loss's forward (only backward recomputes)
    and a second dh and dW in backward (they are scaled in place); it missed the head's input beside dh."""
    res = load("recipes/llama3.1-405b.toml", SHRUNK_405B)
    (last,) = [r for r in roles(res) if r.pp_stage == 1]
    (row,) = report(res, [run_role(res, last)], 80, 0.0)["roles"]
    measured, planned = row["measured_peak_bytes"], row["planned_peak_bytes"]
    assert abs(measured - planned) <= 0.05 * planned, (measured, planned, row["by_category"])
