"""The fit verdict's model states (recipes/planner/fit.py) are what megazoo's ZeRO optimizers hold: planner.py's
megazoo_state_memory, which tests/recipes/planner/test_planner_megazoo.py proves equal to the optimizers' memory_bytes(). The ZeRO
paper's bytes (model_state_memory) stay reachable with `paper=True` / `megazoo plan --recipe ... --paper`, and
they differ where megazoo keeps the owned gradient shard in fp32 (ZeRO 1-3)."""

from __future__ import annotations

import pytest

from megazoo.models.presets import get_preset
from megazoo.recipes.planner.zero import (GB, MIXED_ADAM, PlanError, megazoo_state_memory,
                                           model_state_memory)
from megazoo.recipes.planner import cli as plan_cli
from megazoo.recipes.planner.cost_model import CostModel, search
from megazoo.recipes.planner.fit import Layout, device_memory, state_memory
from megazoo.recipes.gpus import GPUS
from megazoo.recipes.planner.shards import shard_parameters

CFG = get_preset("gpt2-345m")
# bytes per parameter at dp x cp = 4, bf16/fp16: megazoo (planner docstring) and the ZeRO paper's Table 1
MEGAZOO_B = {0: 16, 1: 2 + 2 + 16 / 4, 2: 2 + 16 / 4, 3: 18 / 4}
PAPER_B = {0: 16, 1: 2 + 2 + 12 / 4, 2: 2 + 14 / 4, 3: 16 / 4}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "auto"])
def test_fit_model_states_are_megazoos_bytes_not_the_papers(zero, precision, tp):
    psi = shard_parameters(CFG, tp, 1).psi
    lay = Layout(4, tp, 1, zero, precision=precision)
    mem = device_memory(CFG, lay, 32)
    assert mem.psi == psi and not mem.paper
    assert mem.model_states == megazoo_state_memory(psi, 4, zero, "bf16").device_bytes  # auto: bf16 on CUDA
    assert mem.model_states == pytest.approx(MEGAZOO_B[zero] * psi, rel=1e-12)
    paper = device_memory(CFG, lay, 32, paper=True)
    assert paper.paper and paper.model_states == model_state_memory(psi, 4, zero, MIXED_ADAM).device_bytes
    assert paper.model_states == pytest.approx(PAPER_B[zero] * psi, rel=1e-12)
    if zero:  # the owned fp32 gradient: +4/N at stage 1, +2/N at stages 2 and 3
        assert mem.model_states - paper.model_states == pytest.approx((4 if zero == 1 else 2) * psi / 4, rel=1e-12)
    # activations and buffers do not depend on which model-state accounting is used
    assert (mem.activations, mem.buffers) == (paper.activations, paper.buffers)


def test_fp32_offload_pipeline_and_cp_use_the_planner():
    psi = shard_parameters(CFG, 1, 1).psi
    for zero, per_param in ((1, 8 + 12 / 4), (2, 4 + 12 / 4)):
        mem = device_memory(CFG, Layout(4, zero=zero, precision="fp32"), 32)
        assert mem.model_states == megazoo_state_memory(psi, 4, zero, "fp32").device_bytes
        assert mem.model_states == pytest.approx(per_param * psi, rel=1e-12)
    # ZeRO-Offload: owned fp32 grads, masters and moments in CPU memory; the device keeps 2 + 2 at stage 1
    off = device_memory(CFG, Layout(4, zero=1, offload=True), 32)
    assert off.model_states == 4 * psi == megazoo_state_memory(psi, 4, 1, "fp16", offload=True).device_bytes
    # cp ranks hold the same parameters: ZeRO partitions over dp x cp
    lay = Layout(2, zero=2, cp=2)
    assert state_memory(psi, lay) == megazoo_state_memory(psi, 4, 2, "fp16")
    # pipeline: every stage's own count, the fullest stage reported
    mem = device_memory(CFG, Layout(4, 2, 2, 1), 32)
    stage = shard_parameters(CFG, 2, 2).stages[mem.pp_rank]
    assert mem.psi == stage.numel and mem.model_states == megazoo_state_memory(stage.numel, 4, 1, "fp16").device_bytes
    with pytest.raises(PlanError, match="offload needs zero stage >= 1"):
        device_memory(CFG, Layout(4, zero=0, offload=True), 32)


def test_search_uses_the_same_accounting():
    cm = CostModel.for_gpu(GPUS["v100-32gb"])
    for paper in (False, True):
        found = search(CFG, 4, 32, cm, global_batch=8, seq_len=256, zero_stages=(1,), paper=paper)
        assert found
        for c in found:
            lay, psi = c.layout, c.memory.psi
            want = (model_state_memory(psi, lay.dp, 1, MIXED_ADAM) if paper else
                    megazoo_state_memory(psi, lay.dp, 1, "fp16")).device_bytes
            assert c.memory.paper == paper and c.memory.model_states == want


def test_plan_recipe_prints_megazoos_states_and_paper_on_request(capsys):
    argv = ["--model", "gpt2-1.5b", "--dp", "16", "--zero", "1", "--micro-batch", "1", "--gpu", "v100-32gb"]
    psi = shard_parameters(get_preset("gpt2-1.5b"), 1, 1).psi
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"model states: {megazoo_state_memory(psi, 16, 1, 'fp16').device_bytes / GB:.2f} GB" in out
    assert "what megazoo's ZeRO-1 optimizer holds" in out
    assert plan_cli.main(argv + ["--paper"]) == 0
    out = capsys.readouterr().out
    assert f"model states: {model_state_memory(psi, 16, 1).device_bytes / GB:.2f} GB" in out
    assert "the ZeRO paper's formulas at ZeRO-1" in out
    assert f"{megazoo_state_memory(psi, 16, 1, 'fp16').device_bytes / GB:.2f}" != \
        f"{model_state_memory(psi, 16, 1).device_bytes / GB:.2f}"

