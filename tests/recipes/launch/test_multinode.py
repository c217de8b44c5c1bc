"""Multi-node launch (issue 14.3): two torchrun "nodes" on this machine (c10d rendezvous on 127.0.0.1, a shared
run.dir as a cluster has) train the same function as the single-node run; `megazoo launch` starts one node after
checking the recipe; `megazoo launch --slurm` writes an sbatch script for a real cluster.

Every process a test starts names the test's folder (its recipe lives there) and is killed afterwards."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import end_processes, write_recipe
from recipe_stand_ins import stand_in_overrides

from megazoo.recipes.launch import cli as launch_cli
from megazoo.recipes.config import load_recipe

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads per worker in every run (torchrun sets 1 for N > 1)


def _recipe(folder: Path, *, steps: int = 3) -> Path:
    return write_recipe(folder / "recipe.toml", folder / "run", steps=steps, timeout_s=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str]]:
    """(exit status, stderr) of each process; any still running after `timeout` is killed (the test fails)."""
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            err += "\n(killed: it ran past the test's timeout)"
        results.append((proc.returncode, err))
    return results


def _losses(run_dir: Path) -> list[float]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


@pytest.fixture(autouse=True)
def no_process_left(tmp_path):
    """Whatever a test asserts, every process it started (its command line names the test's folder) ends."""
    yield
    end_processes(str(tmp_path))


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> list[float]:
    """The reference: `megazoo train --nproc 2` (one node, two processes, torchrun --standalone)."""
    recipe = _recipe(tmp_path_factory.mktemp("single"))
    [(code, err)] = _finish([_start("-m", "megazoo.recipes.cli", "train", str(recipe), "--nproc", "2")])
    losses = _losses(recipe.parent / "run")
    assert code == 0 and len(losses) == 3, err[-3000:]
    return losses


def _same_function(two_nodes: list[float], one_node: list[float]) -> None:
    # Same ranks, same gloo collectives: equal, at most fp32 reduction-order rounding apart.
    assert len(two_nodes) == len(one_node) == 3
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(two_nodes, one_node)), (two_nodes, one_node)


def test_two_torchrun_nodes_on_one_machine_train_the_single_node_function(tmp_path, single_node):
    recipe, port = _recipe(tmp_path), _free_port()
    nodes = [_start("-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node",
                    "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                    f"test-{port}", "-m", "megazoo.recipes.train", str(recipe)) for rank in (0, 1)]
    results = _finish(nodes)
    losses = _losses(tmp_path / "run")  # rank 0 (on whichever node) writes it into the shared run.dir
    assert [code for code, _ in results] == [0, 0] and len(losses) == 3, "\n".join(e[-2000:] for _, e in results)
    _same_function(losses, single_node)


def test_megazoo_launch_runs_one_node_each_and_matches_the_single_node_run(tmp_path, single_node):
    recipe, port = _recipe(tmp_path), _free_port()
    nodes = [_start("-m", "megazoo.recipes.launch.cli", str(recipe), "--nnodes", "2", "--node-rank", str(rank),
                    "--master", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}") for rank in (1, 0)]
    results = _finish(nodes)
    assert [code for code, _ in results] == [0, 0], "\n".join(e[-2000:] for _, e in results)
    assert "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1" in results[1][1]  # the command, printed first
    _same_function(_losses(tmp_path / "run"), single_node)
    # node 0 owns run.dir: a fresh run into it is refused before anything starts; --resume is not
    again = launch_cli.main([str(recipe), "--nnodes", "2", "--node-rank", "0", "--master", f"127.0.0.1:{port}",
                             "--set", "train.steps=4"])
    assert again == 2


def test_sigterm_stops_every_node_with_a_checkpoint_and_exit_143(tmp_path):
    recipe, port = _recipe(tmp_path, steps=100_000), _free_port()
    run_dir = tmp_path / "run"
    nodes = [_start("-m", "megazoo.recipes.launch.cli", str(recipe), "--nnodes", "2", "--node-rank", str(rank),
                    "--master", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}") for rank in (0, 1)]
    try:
        while len(_losses(run_dir)) < 2 and all(node.poll() is None for node in nodes):
            time.sleep(0.05)
        for node in nodes:  # what srun does with the batch script's SIGTERM: one to each node's launcher
            node.send_signal(signal.SIGTERM)
        results = _finish(nodes)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [code for code, _ in results] == [143, 143], "\n".join(e[-2000:] for _, e in results)
    saved = sorted((run_dir / "checkpoints").glob("step_*/manifest.json"))
    assert saved, "no checkpoint was saved on the stop"
    assert "continue with --resume" in results[0][1]


def test_launch_checks_the_layout_before_any_process_starts(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    base = [str(recipe), "--node-rank", "0", "--master", "127.0.0.1:29500"]
    assert launch_cli.main([*base, "--nnodes", "2", "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert "dp 2 x tp 1 x pp 1 = 2" in err and "--nnodes 2 x --nproc-per-node 2 = 4" in err
    assert launch_cli.main([*base, "--nnodes", "3"]) == 2
    assert "cannot be split over --nnodes 3" in capsys.readouterr().err
    assert launch_cli.main([str(recipe), "--nnodes", "2", "--node-rank", "2", "--master", "h:1"]) == 2
    assert "--node-rank 2 is invalid" in capsys.readouterr().err
    assert launch_cli.main([str(recipe), "--nnodes", "2", "--node-rank", "0", "--master", "node001"]) == 2
    assert "--master 'node001' is invalid" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    assert launch_cli.main([*base, "--nnodes", "2", "--rdzv-id", "job7", "--dry-run", "--set", "train.steps=5"]) == 0
    command = capsys.readouterr().out.split()
    assert command[1:] == ["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node",
                           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-id", "job7",
                           "-m", "megazoo.recipes.train", str(recipe), "--set", "train.steps=5"]


def _slurm(tmp_path: Path, *args: str) -> list[str]:
    tnlg, scratch = REPO / "recipes" / "tnlg-17b.toml", tmp_path / "stand-ins"
    if not scratch.exists():  # a stand-in corpus: the recipe's data files are checked before anything is written
        scratch.mkdir()
        (scratch / "sets.json").write_text(json.dumps(stand_in_overrides(tnlg, scratch)))
    sets = [a for s in json.loads((scratch / "sets.json").read_text()) for a in ("--set", s)]
    return ["--slurm", str(tnlg), *sets, *args]


def test_slurm_script_for_tnlg_17b_renders_and_fills_its_256_gpus(tmp_path, capsys):
    # run.dir on a shared path (rendering writes nothing there): the recipe's own relative runs/ resolves against
    # the working folder, which is node-local when the checkout lives under /tmp, and this test must not depend
    # on where the checkout lives.
    out, shared = tmp_path / "tnlg.sbatch", "/shared/megazoo-test/runs/tnlg-17b"
    code = launch_cli.main(_slurm(tmp_path, "--nodes", "32", "--gpus-per-node", "8", "--partition", "gpu",
                                  "--time", "24:00:00", "--account", "proj", "--out", str(out),
                                  "--set", f"run.dir={shared}"))
    assert code == 0, capsys.readouterr().err
    script = out.read_text()
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M))
    par = load_recipe(REPO / "recipes" / "tnlg-17b.toml").parallel
    assert int(flags["nodes"]) * int(flags["gpus-per-node"]) == par.dp * par.tp * par.pp == 256
    assert flags["ntasks-per-node"] == "1" and flags["signal"] == "B:TERM@120" and "requeue" in flags
    assert (flags["partition"], flags["time"], flags["account"]) == ("gpu", "24:00:00", "proj")
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    assert "--nproc-per-node 8" in script and '--master "$head_node:$rdzv_port"' in script
    assert "--resume" in script and '--node-rank "$SLURM_NODEID"' in script and "trap on_term TERM" in script
    assert "shares" in script and "scontrol requeue" in script
    check = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert shared in script and not Path("/shared/megazoo-test").exists()


def test_slurm_refuses_a_wrong_layout_and_a_node_local_run_dir(tmp_path, capsys):
    assert launch_cli.main(_slurm(tmp_path, "--nodes", "16", "--gpus-per-node", "8")) == 2
    err = capsys.readouterr().err
    assert "dp 64 x tp 4 x pp 1 = 256" in err and "--nnodes 16 x --nproc-per-node 8 = 128" in err
    assert launch_cli.main(_slurm(tmp_path, "--nodes", "32", "--gpus-per-node", "8", "--set",
                                  "run.dir=/tmp/tnlg")) == 2
    assert "run.dir /tmp/tnlg is on node-local storage" in capsys.readouterr().err
    assert launch_cli.main(_slurm(tmp_path, "--nodes", "32")) == 2
    assert "--slurm needs --nodes N and --gpus-per-node G" in capsys.readouterr().err


def test_launch_takes_a_shipped_recipe_name_and_forwards_data_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the repository: the name must resolve to the installed recipe
    data = tmp_path / "corpora"
    data.mkdir()
    base = ["demo", "--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:29500"]
    assert launch_cli.main([*base, "--data-dir", str(data), "--dry-run"]) == 0, capsys.readouterr().err
    command = capsys.readouterr().out.split()
    recipe = Path(command[command.index("megazoo.recipes.train") + 1])
    assert recipe.is_file() and recipe.name == "demo.toml"
    assert command[command.index("--data-dir") + 1] == str(data)
    assert launch_cli.main(["no-such-recipe", *base[1:], "--dry-run"]) == 2
    assert "neither a file nor a shipped recipe" in capsys.readouterr().err
    assert launch_cli.main([*base, "--data-dir", str(tmp_path / "missing"), "--dry-run"]) == 2
    assert "--data-dir" in capsys.readouterr().err
    out = tmp_path / "demo.sbatch"
    code = launch_cli.main(["--slurm", "demo", "--nodes", "1", "--gpus-per-node", "2", "--data-dir", str(data),
                            "--set", "run.dir=/shared/runs/demo", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert f"--data-dir {data}" in out.read_text()
