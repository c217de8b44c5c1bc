"""`megazoo plan` on a fault-tolerant recipe: ZeRO shards inside a replica group, the heal's memory (a full copy of
a rank's state in flight, in host memory) printed, and a node whose host memory cannot hold it refused (exit 3)."""

from __future__ import annotations

import re

from megazoo.models.presets import get_preset
from megazoo.recipes.planner import cli as plan_cli
from megazoo.recipes.planner.zero import GB

RECIPE = "recipes/gpt2-1.5b.toml"  # dp 16, ZeRO-1
FT = ["--set", "fault_tolerance.enabled=true", "--set", "fault_tolerance.replica_groups=4"]


def _plan(capsys, *argv):
    code = plan_cli.main(["--recipe", RECIPE, "--gpu-memory", "80", *argv])
    return code, capsys.readouterr().out


def _gb(pattern: str, out: str) -> float:
    return float(re.search(pattern, out).group(1))


def test_the_heal_is_a_full_copy_of_a_group_ranks_state_and_must_fit_the_host(capsys):
    psi = get_preset("gpt2-1.5b").num_parameters()
    code, plain = _plan(capsys, "--set", "train.precision=bf16")
    assert code == 0 and "heal" not in plain
    code, out = _plan(capsys, "--set", "train.precision=bf16", *FT, "--gpus-per-node", "8")
    assert code == 0 and "heal: host memory not checked" in out
    # ZeRO-1 inside a group of dp 16 / 4 = 4: each rank holds a quarter of the fp32 masters and moments (12 bytes a
    # parameter; the heal sends them) and of the owned fp32 gradient (4 bytes; not sent) where plain dp 16 holds a
    # sixteenth; the bf16 parameters are whole on every rank
    per_rank = (2 * psi + 12 * psi / 4) / GB
    assert abs(_gb(r"state from a live group: ([\d.]+) GB per rank", out) - per_rank) < 0.01
    assert abs(_gb(r"([\d.]+) GB per node of 8 GPUs", out) - 8 * per_rank) < 0.05
    states = lambda text: _gb(r"model states: ([\d.]+) GB", text)  # noqa: E731
    assert abs(states(out) - states(plain) - 16 * psi * (1 / 4 - 1 / 16) / GB) < 0.01
    code, out = _plan(capsys, "--set", "train.precision=bf16", *FT, "--gpus-per-node", "8", "--host-memory", "1000")
    assert code == 0 and "heal fits" in out
    code, out = _plan(capsys, "--set", "train.precision=bf16", *FT, "--gpus-per-node", "8", "--host-memory", "48")
    assert code == 3 and "heal does NOT fit" in out and "exceeds --host-memory 48 GB" in out
    assert "more ranks per replica group" in out


def test_a_bad_host_memory_is_named(capsys):
    code = plan_cli.main(["--recipe", RECIPE, "--gpu-memory", "80", *FT, "--host-memory", "lots"])
    assert code == 2 and "--host-memory 'lots' is invalid" in capsys.readouterr().err
