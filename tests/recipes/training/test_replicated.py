"""recipes/training/replicated.py's entry-point half: where a replica group is, from the launcher's environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipe_helpers import tiny_recipe

from megazoo.recipes.config import RecipeError
from megazoo.recipes.training.replicated import replica_setup
from megazoo.workers.replica_groups import GROUP_ENV, LIGHTHOUSE_ENV, RESTART_ENV

FT = {"enabled": True, "replica_groups": 2, "lighthouse": "http://given:29510"}


def test_without_fault_tolerance_nothing_changes():
    recipe = tiny_recipe()
    assert replica_setup(recipe, {GROUP_ENV: "1"}) == (recipe, None)


def test_a_group_gets_its_own_run_dir_lighthouse_and_store():
    recipe = tiny_recipe(parallel={"dp": 4}, run={"dir": "runs/x"}, fault_tolerance=FT)
    env = {GROUP_ENV: "1", LIGHTHOUSE_ENV: "http://started:1234", RESTART_ENV: "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "node3", "MASTER_PORT": "29400"}
    mine, spec = replica_setup(recipe, env)
    assert Path(mine.run.dir) == Path("runs/x/group-1")  # groups never write each other's files
    assert (spec.index, spec.groups, spec.lighthouse, spec.store, spec.restarted) == \
        (1, 2, "http://started:1234", ("node3", 29400), True)
    # one process per group: no torchrun store (the group makes its own); the recipe's lighthouse when none is set
    _, solo = replica_setup(recipe, {GROUP_ENV: "0"})
    assert (solo.store, solo.lighthouse, solo.restarted) == (None, "http://given:29510", False)


def test_started_without_the_launcher_is_refused_with_how_to_start_it():
    with pytest.raises(RecipeError, match="start the run with `megazoo train`.*MEGAZOO_REPLICA_GROUP unset"):
        replica_setup(tiny_recipe(parallel={"dp": 2}, fault_tolerance=FT), {})


def test_a_replica_groups_run_counts_as_a_previous_run(tmp_path):
    """`megazoo train` into a run.dir whose groups wrote checkpoints or metrics refuses a fresh start (--resume or
    --overwrite), as for any run: the groups' folders are looked into."""
    from megazoo.recipes.training.run_dir import previous_run
    (tmp_path / "group-1" / "checkpoints" / "step_00000010").mkdir(parents=True)
    (tmp_path / "group-0").mkdir()
    (tmp_path / "group-0" / "metrics.jsonl").write_text('{"step": 0}\n')
    assert previous_run(tmp_path) == ["group-0/metrics.jsonl", "group-1/1 checkpoint(s) up to step_00000010"]
