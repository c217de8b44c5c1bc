"""gpt-100b and gpt-1t dry-run whole at their full world size against the planner (the checks and why the
pipeline recipes run fewer micro-batches: tests/recipes/planner/test_dry_run_shipped.py)."""

from __future__ import annotations

import pytest
from dry_run_helpers import check_whole_dry_run

WHOLE_3D = [("gpt-100b", ["train.grad_accum=2", "train.global_batch=200"], 32), ("gpt-1t", None, 32)]


@pytest.mark.parametrize("name, sets, gpu_gb", WHOLE_3D, ids=[w[0] for w in WHOLE_3D])
def test_3d_recipe_dry_runs_whole_and_agrees_with_the_planner(name, sets, gpu_gb):
    check_whole_dry_run(name, sets, gpu_gb)
