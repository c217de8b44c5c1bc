"""benchmarks/diloco.py without root: argument checks, the torchrun commands and every layout's recipe (each
resolves, DiLoCo's with its H and outer lr). The benchmark itself needs root (network namespaces) and is run by
hand; its table is in the README's DiLoCo section."""

from __future__ import annotations

import pytest

from benchmarks import diloco as bench
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import resolve


def test_defaults_compare_every_layout_at_equal_steps():
    args = bench.parse_args([])
    assert args.layouts == list(bench.LAYOUTS) and bench.BASELINE == args.layouts[0] == "flat-zero1"
    assert args.steps % args.inner_steps == 0 and args.rate == "100mbit" and not args.worker


@pytest.mark.parametrize("argv, message", [
    (["--rate", "10mb"], "--rate: rate '10mb' is not a tc rate in bits per second; valid:"),
    (["--layouts", "diloco,zero4"], "--layouts zero4 unknown; valid: flat-zero1, hsdp-zero1"),
    (["--steps", "20", "--inner-steps", "8"], "--steps = 20 / --inner-steps = 8: valid: inner steps >= 1 and steps"),
    (["--inner-steps", "0"], "--inner-steps = 0: valid: inner steps >= 1"),
    (["--outer-lr", "0"], "--outer-lr = 0.0 is invalid; valid: a number > 0"),
    (["--lr", "0"], "--lr = 0.0 is invalid; valid: a number > 0"),
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", list(bench.LAYOUTS))
def test_every_layout_resolves_with_the_same_model_and_batch(name, tmp_path):
    args = bench.parse_args(["--inner-steps", "4", "--steps", "8", "--outer-lr", "0.5", "--lr", "1e-3"])
    res = resolve(from_dict(Recipe, bench.recipe(name, args, str(tmp_path))), world_size=4)
    assert res.recipe.parallel.dp == 4 and res.recipe.parallel.node_size == 2 and res.recipe.train.steps == 8
    assert res.tokens_per_step == 256 and res.recipe.train.lr == 1e-3
    d = res.recipe.diloco
    assert d.enabled == name.startswith("diloco")
    if d.enabled:
        assert (d.inner_steps, d.outer_lr, res.recipe.zero.shard_group) == (4, 0.5, "node")
        assert d.compression == {"diloco": "none", "diloco-onebit": "onebit", "diloco-int8": "int8"}[name]


def test_each_node_runs_its_torchrun_in_its_namespace():
    args = bench.parse_args(["--layouts", "hsdp-zero1,diloco"])
    argv, env = bench.node_command(1, args)
    assert argv[:4] == ["ip", "netns", "exec", bench.PAIR.namespaces[1]]
    assert argv[argv.index("--node-rank") + 1] == "1" and argv[argv.index("--master-addr") + 1] == bench.PAIR.address(0)
    after = argv.index("--max-restarts") + 2
    assert argv[after:after + 3] == ["-m", "benchmarks.diloco", "--worker"]
    assert argv[argv.index("--layouts") + 1] == "hsdp-zero1,diloco"
    assert env["GLOO_SOCKET_IFNAME"] == bench.PAIR.veths[1]
