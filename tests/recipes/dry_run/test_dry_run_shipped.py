"""Shipped recipes dry-run whole at their full world size against the planner (tests/recipes/planner/
test_dry_run.py proves the dry run against real runs; test_dry_run_shipped_3d.py holds the two largest 3D recipes,
in a file of their own so that two test workers share the load)."""

from __future__ import annotations

import pytest
from dry_run_helpers import check_whole_dry_run

# Real size: shipped recipes whole - full world size, depth, widths, batch shapes, ZeRO stage and precision - each
# in well under a minute here. The pipeline recipes run pp micro-batches per step (pipeline_depth_overrides) and
# gpt-100b 2 of its 4: 1F1B's peak is reached once pp micro-batches are in flight, ZeRO-2's once one micro-batch
# has been reduced, and no stage's peak grows with the micro-batches of a step
# (test_a_pipeline_stage_holds_no_activation_past_its_backward).
WHOLE = [("tnlg-17b", [], 32), ("megatron-8.3b", [], 32),
         # sequence parallelism: activations 1.1 GB instead of 7.5 GB per GPU, the planner within 2% (both)
         ("megatron-8.3b", ["parallel.sequence_parallel=true"], 24),
         ("gpt3-175b", None, 80)]  # None: pipeline_depth_overrides


@pytest.mark.parametrize("name, sets, gpu_gb", WHOLE, ids=[w[0] + ("-sp" if w[1] and "sequence" in w[1][0] else "")
                                                        for w in WHOLE])
def test_shipped_recipe_dry_runs_whole_and_agrees_with_the_planner(name, sets, gpu_gb):
    check_whole_dry_run(name, sets, gpu_gb)
