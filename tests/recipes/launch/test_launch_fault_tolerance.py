"""`megazoo launch` with [fault_tolerance]: a node runs its replica group's torchrun (its own rendezvous, restarted
alone by --max-restarts, the lighthouse named); `--lighthouse-only` starts the lighthouse and prints its address;
the Slurm script starts the lighthouse and one task per node in its group; `--kubernetes` renders a JobSet (one
Indexed Job per group, the lighthouse as a Service), parsed and checked here."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megazoo.recipes.launch import cli as launch_cli

SHARED = "/shared/megazoo-test/runs/ft"  # rendering writes nothing there
RECIPE = """
[model]
preset = "gpt2-tiny"
n_layer = 2
vocab_size = 300
[parallel]
dp = 8
tp = 2
[train]
steps = 10
micro_batch = 1
seq_len = 32
[data]
source = "synthetic"
synthetic_tokens = 20000
[run]
dir = "{run_dir}"
[fault_tolerance]
enabled = true
replica_groups = 4
max_group_restarts = 5
"""


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "ft.toml"
    path.write_text(RECIPE.format(run_dir=tmp_path / "run"))
    return path


def test_a_node_runs_its_groups_torchrun_with_its_restarts_and_the_lighthouse(recipe, tmp_path, capsys):
    base = [str(recipe), "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1", "--master", "g3head:29500"]
    assert launch_cli.main(base) == 2
    assert "give --replica-group G (0 .. 3)" in capsys.readouterr().err
    assert launch_cli.main([*base, "--replica-group", "4", "--lighthouse", "http://lh:29510"]) == 2
    assert "--replica-group 4 is invalid; valid: 0 .. 3" in capsys.readouterr().err
    assert launch_cli.main([*base, "--replica-group", "3"]) == 2
    assert "needs the lighthouse's address: give --lighthouse" in capsys.readouterr().err
    assert launch_cli.main([*base, "--replica-group", "3", "--lighthouse", "lh:29510"]) == 2
    assert "--lighthouse 'lh:29510' is invalid" in capsys.readouterr().err
    # a group is dp 8 / 4 groups = 2 x tp 2 = 4 processes: 2 nodes x 2, not the whole job's 16
    assert launch_cli.main([*base, "--nnodes", "4", "--replica-group", "3", "--lighthouse", "http://lh:29510"]) == 2
    assert "= 4 processes does not match --nnodes 4 x --nproc-per-node 2 = 8" in capsys.readouterr().err
    assert launch_cli.main([*base, "--replica-group", "3", "--lighthouse", "http://lh:29510", "--dry-run"]) == 0
    command = capsys.readouterr().out.split()
    assert command[command.index("--max-restarts") + 1] == "5"  # torchrun restarts this group alone
    assert command[command.index("--rdzv-endpoint") + 1] == "g3head:29500"
    assert not (tmp_path / "run").exists()


def test_lighthouse_only_starts_the_lighthouse_and_prints_its_address(recipe):
    proc = subprocess.Popen([sys.executable, "-m", "megazoo.recipes.launch.cli", str(recipe), "--lighthouse-only",
                             "--lighthouse-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert re.fullmatch(r"http://[^:]+:\d+", address), address
        import urllib.request
        with urllib.request.urlopen(address + "/", timeout=10) as reply:
            assert reply.status == 200  # torchft's lighthouse answers with its status page
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 128 + 15 and "torchft lighthouse at http" in proc.stderr.read()


def test_slurm_script_starts_the_lighthouse_and_each_node_in_its_group(recipe, tmp_path, capsys):
    out = tmp_path / "ft.sbatch"
    assert launch_cli.main(["--slurm", str(recipe), "--nodes", "8", "--gpus-per-node", "2", "--out", str(out),
                            "--set", f"run.dir={SHARED}"]) == 0, capsys.readouterr().err
    script = out.read_text()
    assert "--no-kill" in script and "--kill-on-bad-exit=0" in script
    assert "--lighthouse-only --lighthouse-port \"$lighthouse_port\"" in script
    assert 'export MEGAZOO_LIGHTHOUSE="http://$head_node:$lighthouse_port"' in script
    assert 'echo "megazoo: torchft lighthouse at $MEGAZOO_LIGHTHOUSE' in script  # named in the job's log
    assert "--nnodes 2 --nproc-per-node 2" in script and '--lighthouse "$MEGAZOO_LIGHTHOUSE"' in script
    check = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    # each node's task: run its bash -c line for every SLURM_NODEID with a stand-in megazoo that prints its args
    task = shlex.split(re.search(r"bash -c ('[^']*') megazoo-node", script).group(1))[0]
    nodes = [f"n{i}" for i in range(8)]
    for node in range(8):
        shim = ('scontrol() { printf "%s\\n" ' + " ".join(nodes) + '; }; megazoo() { echo "$@"; }; '
                + task.replace("exec ", ""))
        got = subprocess.run(["bash", "-c", shim, "x", "--resume"], capture_output=True, text=True, timeout=60,
                             env={"SLURM_NODEID": str(node), "SLURM_JOB_ID": "7", "rdzv_port": "29500",
                                  "SLURM_JOB_NODELIST": "n[0-7]", "PATH": "/usr/bin:/bin"}).stdout.split()
        group = node // 2
        assert got[got.index("--replica-group") + 1] == str(group)
        assert got[got.index("--node-rank") + 1] == str(node % 2)
        assert got[got.index("--master") + 1] == f"n{2 * group}:29500"  # the group's first node
        assert got[got.index("--rdzv-id") + 1] == f"7-group{group}"
    assert launch_cli.main(["--slurm", str(recipe), "--nodes", "2", "--gpus-per-node", "8",
                            "--set", f"run.dir={SHARED}"]) == 2
    assert "--nodes 2 cannot be split into fault_tolerance.replica_groups = 4" in capsys.readouterr().err


def _manifest(recipe, capsys, *extra) -> tuple[int, str, str]:
    code = launch_cli.main(["--kubernetes", str(recipe), "--nodes", "8", "--gpus-per-node", "2",
                            "--image", "reg/megazoo:1", "--pvc", "runs", "--set", f"run.dir={SHARED}", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_kubernetes_jobset_has_a_group_per_job_and_the_lighthouse_as_a_service(recipe, capsys):
    code, text, err = _manifest(recipe, capsys, "--job-name", "ft-run")
    assert code == 0, err
    service, jobset = yaml.safe_load_all(text)
    assert service["kind"] == "Service" and service["metadata"]["name"] == "ft-run-lighthouse"
    assert service["spec"]["ports"][0]["port"] == 29510
    assert service["spec"]["selector"]["jobset.sigs.k8s.io/replicatedjob-name"] == "lighthouse"
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
    spec = jobset["spec"]
    assert spec["failurePolicy"] == {"maxRestarts": 0}  # never a JobSet-wide restart
    assert spec["successPolicy"] == {"operator": "Any", "targetReplicatedJobs": ["group"]}
    jobs = {j["name"]: j for j in spec["replicatedJobs"]}
    lighthouse = jobs["lighthouse"]["template"]["spec"]
    assert jobs["lighthouse"]["replicas"] == 1 and lighthouse["parallelism"] == 1
    serve = lighthouse["template"]["spec"]["containers"][0]["command"]
    assert serve[:3] == ["megazoo", "launch", str(recipe)] and "--lighthouse-only" in serve
    assert lighthouse["template"]["spec"]["restartPolicy"] == "OnFailure"
    group = jobs["group"]
    job = group["template"]["spec"]
    assert group["replicas"] == 4  # one Job per replica group
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == 2  # 8 nodes / 4
    assert job["backoffLimit"] == 5 * 2  # max_group_restarts per pod
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == "ft-run"
    container = pod["containers"][0]
    assert container["image"] == "reg/megazoo:1" and container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "runs"
    env = {e["name"]: e for e in container["env"]}
    assert env["JOB_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["MEGAZOO_FT_HOSTNAME"]["value"] == "$(POD_NAME).ft-run"
    # each pod's command is a valid `megazoo launch` of its group's node: run it through the real parser and checks
    shell, flag, line = container["command"]
    assert (shell, flag) == ("bash", "-c")
    for group_index, node in ((0, 0), (3, 1)):
        argv = shlex.split(line.replace("$JOB_INDEX", str(group_index)).replace("$NODE_RANK", str(node)))
        assert argv[:3] == ["exec", "megazoo", "launch"]
        args = argv[3:]
        assert args[args.index("--master") + 1] == f"ft-run-group-{group_index}-0.ft-run:29500"
        assert args[args.index("--lighthouse") + 1] == "http://ft-run-lighthouse:29510"
        assert launch_cli.main([*args, "--dry-run"]) == 0, capsys.readouterr().err
        torchrun = capsys.readouterr().out.split()
        assert torchrun[torchrun.index("--node-rank") + 1] == str(node)
        assert torchrun[torchrun.index("--nproc-per-node") + 1] == "2"


def test_kubernetes_refuses_what_a_cluster_could_not_run(recipe, capsys):
    code, _, err = _manifest(recipe, capsys, "--set", "run.dir=/elsewhere/run")
    assert code == 2 and "run.dir /elsewhere/run is not on the shared volume mounted at /shared" in err
    code = launch_cli.main(["--kubernetes", str(recipe), "--nodes", "8", "--gpus-per-node", "2", "--pvc", "runs",
                            "--set", f"run.dir={SHARED}"])
    assert code == 2 and "--kubernetes needs --image IMAGE" in capsys.readouterr().err
    code, _, err = _manifest(recipe, capsys, "--job-name", "Bad_Name")
    assert code == 2 and "--job-name 'Bad_Name' is invalid for Kubernetes" in err
