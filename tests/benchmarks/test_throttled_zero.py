"""benchmarks/throttled_zero.py and benchmarks/netns.py without root: argument checks, rate checks, the two
torchrun commands (which namespace, which rendezvous, which env) and the layouts' recipes. Pure functions only;
the benchmark itself needs root and is run by hand (its numbers are in the README)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import netns, throttled_zero as tz
from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import resolve


@pytest.mark.parametrize("rate", ["none", "100mbit", "1gbit", "2.5gbit", "800kbit", "1000000bit"])
def test_tc_rates_accepted(rate):
    assert netns.check_rate(rate) == rate


@pytest.mark.parametrize("rate", ["100mb", "100mbps", "1 gbit", "fast", "", "-1gbit", "gbit"])
def test_bad_rate_names_the_value_and_what_is_valid(rate):
    with pytest.raises(ValueError, match=r"rate .* is not a tc rate in bits per second; valid: 'none'.*100mbit"):
        netns.check_rate(rate)


def test_defaults():
    args = tz.parse_args([])
    assert args.rates == ["100mbit", "1gbit"] and args.layouts == list(tz.LAYOUTS)
    assert not args.worker and args.rounds >= 1 and args.warm >= 3
    assert tz.BASELINE == args.layouts[0] == "flat-zero3"


@pytest.mark.parametrize("argv, message", [
    (["--rates", "100mbit,10mb"], "--rates: rate '10mb' is not a tc rate in bits per second; valid:"),
    (["--rates", ","], "--rates is empty; valid:"),
    (["--layouts", "flat-zero3,zero4"], "--layouts zero4 unknown; valid: flat-zero3, hsdp-zero3, hpz, hpz+qwz, hpz+qwz+qgz"),
    (["--rounds", "0"], "--rounds = 0 is too small; valid: an integer >= 1"),
    (["--timed", "0"], "--timed = 0 is too small; valid: an integer >= 1"),
    (["--warm", "2"], "--warm = 2 is too small; valid: an integer >= 3 (1-bit Adam compresses from step 2"),
    (["--port", "80"], "--port = 80 is invalid; valid: 1024 .. "),
    (["--rounds", "two"], "argument --rounds: invalid int value: 'two'"),
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tz.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_node_commands_one_torchrun_per_namespace():
    args = tz.parse_args(["--layouts", "hpz,onebit-zero1", "--rounds", "3", "--warm", "4", "--timed", "2"])
    commands = [tz.node_command(node, args, 29900) for node in range(2)]
    for node, (argv, env) in enumerate(commands):
        # ip netns exec <this node's namespace> python -m torch.distributed.run ... -m benchmarks.throttled_zero
        assert argv[:5] == ["ip", "netns", "exec", tz.PAIR.namespaces[node], sys.executable]
        assert argv[5:7] == ["-m", "torch.distributed.run"]
        opts = dict(zip(argv[7:19:2], argv[8:19:2]))
        assert opts == {"--nnodes": "2", "--nproc-per-node": "2", "--node-rank": str(node),
                        "--master-addr": tz.PAIR.address(0), "--master-port": "29900", "--max-restarts": "0"}
        assert argv[19:] == ["-m", "benchmarks.throttled_zero", "--worker", "--layouts", "hpz,onebit-zero1",
                             "--rounds", "3", "--warm", "4", "--timed", "2"]
        # gloo on this namespace's veth end; both nodes meet at node 0's veth address
        assert env == {"GLOO_SOCKET_IFNAME": tz.PAIR.veths[node], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    assert tz.PAIR.address(0) == "10.231.78.1" and tz.PAIR.address(1) == "10.231.78.2"
    assert commands[0][1]["GLOO_SOCKET_IFNAME"] != commands[1][1]["GLOO_SOCKET_IFNAME"]
    # the worker side parses what the launch passes
    worker = tz.parse_args(commands[0][0][21:])
    assert worker.worker and worker.layouts == ["hpz", "onebit-zero1"] and worker.rounds == 3


def test_namespaces_differ_from_the_compressed_benchmark():
    from benchmarks import compressed

    assert not set(tz.PAIR.namespaces) & set(compressed.PAIR.namespaces)
    assert not set(tz.PAIR.veths) & set(compressed.PAIR.veths)
    assert tz.PAIR.subnet != compressed.PAIR.subnet


@pytest.mark.parametrize("name", list(tz.LAYOUTS))
def test_layout_recipes_resolve_at_2_nodes_of_2(name, tmp_path):
    res = resolve(from_dict(Recipe, tz.layout_recipe(name, 9, str(tmp_path))))
    recipe = res.recipe
    assert (recipe.parallel.dp, recipe.parallel.node_size) == (4, 2)
    zero, optimizer = tz.LAYOUTS[name]
    for key, value in zero.items():
        assert getattr(recipe.zero, key) == value
    assert recipe.optimizer.name == optimizer.get("name", "adamw")
    if optimizer:
        assert recipe.optimizer.freeze_step < tz.parse_args([]).warm  # only compressed steps are timed


def test_without_root_it_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "not root" in netns.missing_privileges()
    assert tz.main(["--rates", "1gbit"]) == 2
    assert "not root" in capsys.readouterr().err


def test_summary_medians_and_ratio_to_flat_zero3():
    rows = [{"rate": "1gbit", "layout": name, "round": r, "tokens_per_s": tps, "step_s": 256 / tps,
             "inter_bytes_per_step": inter, "intra_bytes_per_step": 0.0}
            for r, (name, tps, inter) in enumerate([("flat-zero3", 100.0, 8.0), ("hpz", 150.0, 6.0),
                                                    ("flat-zero3", 120.0, 8.0), ("hpz", 210.0, 6.0),
                                                    ("flat-zero3", 110.0, 8.0), ("hpz", 165.0, 6.0)])]
    summary = {r["layout"]: r for r in tz.summarize(rows)}
    assert summary["flat-zero3"]["tokens_per_s"] == 110.0 and summary["flat-zero3"]["vs_flat_zero3"] == 1.0
    assert summary["hpz"]["tokens_per_s"] == 165.0 and summary["hpz"]["vs_flat_zero3"] == pytest.approx(1.5)
    assert summary["hpz"]["inter_bytes_per_step"] == 6.0
