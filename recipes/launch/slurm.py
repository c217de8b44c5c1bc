"""The sbatch script of `megazoo launch --slurm`: one torchrun per node, started by srun, c10d rendezvous on the
first node of the allocation, run.dir on shared storage, a save-and-requeue on preemption or time limit.

How a stop works: `#SBATCH --signal=B:TERM@120` sends SIGTERM to the batch shell 120 s before the time limit;
its trap forwards it once to srun, which forwards it to each node's `megazoo launch`, which forwards it to its
workers: they finish the step, save a checkpoint and stop, and every launcher exits 143. The script then
requeues the job (`scontrol requeue`; `--requeue` lets Slurm requeue it on preemption too), and the requeued job
runs the same script, whose `--resume` continues from the latest good checkpoint in run.dir.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megazoo.recipes.config import Recipe, RecipeError

SIGNAL_BEFORE_S = 120  # seconds between the stop signal and the time limit: the checkpoint must be saved by then
NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm")  # never shared between nodes


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int
    gpus_per_node: int
    partition: str | None = None
    time: str | None = None  # HH:MM:SS (or D-HH:MM:SS)
    account: str | None = None
    job_name: str | None = None
    port: int = 29500


def shared_run_dir(recipe: Recipe, workdir: Path) -> Path:
    """run.dir as every node sees it (relative to the job's working directory); RecipeError when it is on
    node-local storage, where the nodes would not see each other's checkpoints."""
    run_dir = Path(recipe.run.dir)
    run_dir = run_dir if run_dir.is_absolute() else workdir / run_dir
    local = [p for p in (*NODE_LOCAL, tempfile.gettempdir()) if run_dir == Path(p) or Path(p) in run_dir.parents]
    if local:
        raise RecipeError(f"run.dir {run_dir} is on node-local storage ({local[0]}): a multi-node job needs a "
                          f"run.dir on storage every node shares (checkpoints are written by every rank, "
                          f"metrics by rank 0); set run.dir to a path on a shared filesystem, e.g. "
                          f"--set run.dir=/shared/runs/{run_dir.name}")
    return run_dir


def _check(options: SlurmOptions) -> None:
    if options.time is not None and not re.fullmatch(r"(\d+-)?\d{1,3}:\d{2}:\d{2}", options.time):
        raise RecipeError(f"--time {options.time!r} is invalid: it must be HH:MM:SS or D-HH:MM:SS")
    if not 0 < options.port < 65536:
        raise RecipeError(f"--port {options.port} is invalid: it must be 1 .. 65535")
    for name, value in (("--partition", options.partition), ("--account", options.account),
                        ("--job-name", options.job_name)):
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_.+-]+", value):
            raise RecipeError(f"{name} {value!r} is invalid: use letters, digits and _ . + - only")


def render_sbatch(recipe: Recipe, recipe_path: Path, overrides: list[str], options: SlurmOptions, *,
                  workdir: Path, python: str = sys.executable, data_dir: str | None = None) -> str:
    """The sbatch script (text) that trains `recipe` on options.nodes x options.gpus_per_node GPUs. The caller
    has checked the layout (nodes x GPUs = dp x tp x pp); this checks run.dir is on shared storage."""
    _check(options)
    run_dir = shared_run_dir(recipe, workdir)
    par, q = recipe.parallel, shlex.quote
    recipe_file = recipe_path if recipe_path.is_absolute() else workdir / recipe_path
    name = options.job_name or recipe_path.stem
    world = options.nodes * options.gpus_per_node
    sbatch = [f"--job-name={name}", f"--nodes={options.nodes}", "--ntasks-per-node=1",
              f"--gpus-per-node={options.gpus_per_node}", f"--chdir={workdir}", f"--output={workdir}/{name}-%j.out",
              "--requeue", f"--signal=B:TERM@{SIGNAL_BEFORE_S}", "--open-mode=append"]
    sbatch += [f"--partition={options.partition}"] * (options.partition is not None)
    sbatch += [f"--time={options.time}"] * (options.time is not None)
    sbatch += [f"--account={options.account}"] * (options.account is not None)
    sbatch += ["--no-kill"] * recipe.fault_tolerance.enabled  # a failed node ends its group's tasks, not the job
    sets = "".join(f" \\\n    --set {q(text)}" for text in overrides)
    sets += f" \\\n    --data-dir {q(os.path.abspath(data_dir))}" if data_dir else ""
    bin_dir = Path(python).parent
    lines = [
        "#!/bin/bash",
        f"# megazoo: {recipe_path.name} on {options.nodes} nodes x {options.gpus_per_node} GPUs = {world} = "
        f"dp {par.dp} x tp {par.tp} x pp {par.pp}",
        "# Written by `megazoo launch --slurm`; submit it with sbatch (it requeues itself after a stop).",
        *(f"#SBATCH {flag}" for flag in sbatch),
        "",
        "# run.dir must be on storage that every node shares (not /tmp, which each node has its own of): rank 0",
        "# writes metrics.jsonl there, every rank its checkpoint shards, and a requeued job resumes from it.",
        f"# run.dir: {run_dir}",
        "# The recipe, its data and this environment must be on shared storage too.",
        "set -uo pipefail",
        f"export PATH={q(str(bin_dir))}:\"$PATH\"  # the environment that holds megazoo (the one that wrote this)",
        "",
        "# The c10d rendezvous runs on the first node of the allocation; every node's torchrun joins it there, with",
        "# the job id as the rendezvous id (a requeued job gets a fresh rendezvous). torchrun then sets RANK,",
        "# LOCAL_RANK and WORLD_SIZE for its workers, and each worker uses GPU LOCAL_RANK.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f"rdzv_port={options.port}",
        "",
        "# Preemption or the time limit: forward SIGTERM once to srun (it reaches every node's launcher, which",
        "# makes its workers finish the step, save a checkpoint and stop; the launchers then exit 143).",
        "stopping=0",
        "on_term() {",
        "    stopping=1",
        '    echo "megazoo: SIGTERM: stopping the job with a checkpoint" >&2',
        '    kill -TERM "${srun_pid:-}" 2>/dev/null',
        "}",
        "trap on_term TERM",
        "",
        *(_node_tasks(recipe, recipe_file, options, sets, q) if not recipe.fault_tolerance.enabled else
          _replica_group_tasks(recipe, recipe_file, options, sets, q)),
        "srun_pid=$!",
        'status=0; wait "$srun_pid" || status=$?',
        'if [ "$stopping" = 1 ]; then  # the trap ended the first wait: wait for the save to finish',
        '    status=0; wait "$srun_pid" || status=$?',
        "fi",
        'if [ "$stopping" = 1 ] && [ "$status" = 143 ]; then',
        '    echo "megazoo: saved and stopped; requeueing job $SLURM_JOB_ID (it continues with --resume)" >&2',
        '    scontrol requeue "$SLURM_JOB_ID" || true  # already requeued by Slurm on preemption',
        "fi",
        *(['kill "$lighthouse_pid" 2>/dev/null  # the run is over: the lighthouse is no longer needed']
          if recipe.fault_tolerance.enabled else []),
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def _node_tasks(recipe: Recipe, recipe_file: Path, options: SlurmOptions, sets: str, q) -> list[str]:
    return [
        "# One task per node: `megazoo launch` for that node ($SLURM_NODEID), which runs torchrun with",
        f"# {options.gpus_per_node} workers. --resume: a requeued job continues from the latest good checkpoint.",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "    bash -c 'exec megazoo launch \"$@\" --node-rank \"$SLURM_NODEID\"' megazoo-node \\",
        f"    {q(str(recipe_file))} \\",
        f"    --nnodes \"$SLURM_NNODES\" --nproc-per-node {options.gpus_per_node} \\",
        "    --master \"$head_node:$rdzv_port\" --rdzv-id \"$SLURM_JOB_ID\" --resume" + sets + " &",
    ]


def _replica_group_tasks(recipe: Recipe, recipe_file: Path, options: SlurmOptions, sets: str, q) -> list[str]:
    """[fault_tolerance]: the lighthouse first (on the first node, beside its workers), then one task per node,
    each in its replica group: group g is nodes g x M .. g x M + M - 1 (M nodes per group), its own torchrun
    rendezvous on its first node, restarted alone by torchrun (--max-restarts) while the others train on."""
    from megazoo.recipes.launch.replica_groups import LIGHTHOUSE_PORT, nodes_per_group
    per_group = nodes_per_group(recipe, options.nodes)
    groups = recipe.fault_tolerance.replica_groups
    task = ('nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST")); '
            f'g=$((SLURM_NODEID / {per_group})); '
            'exec megazoo launch "$@" --replica-group "$g" '
            f'--node-rank $((SLURM_NODEID % {per_group})) '
            f'--master "${{nodes[$((g * {per_group}))]}}:$rdzv_port" --rdzv-id "$SLURM_JOB_ID-group$g"')
    return [
        f"# fault tolerance: {groups} replica groups of {per_group} node(s) each, every group its own torchrun job; a",
        "# failed group is restarted alone (torchrun --max-restarts) and heals from a live group over the network.",
        "# torchft's lighthouse (the quorum server every group asks before each step) runs on the first node:",
        f"lighthouse_port={LIGHTHOUSE_PORT}",
        'export MEGAZOO_LIGHTHOUSE="http://$head_node:$lighthouse_port"',
        "srun --overlap --nodes=1 --ntasks=1 -w \"$head_node\" \\",
        f"    megazoo launch {q(str(recipe_file))} --lighthouse-only --lighthouse-port \"$lighthouse_port\"" + sets
        + " &",
        "lighthouse_pid=$!",
        'echo "megazoo: torchft lighthouse at $MEGAZOO_LIGHTHOUSE (on $head_node)" >&2',
        "export rdzv_port",
        "",
        "# One task per node, in its replica group; --kill-on-bad-exit=0: one group's failure must not end the",
        "# others' tasks. --resume: a requeued job continues from each group's latest good checkpoint.",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=0 \\",
        f"    bash -c {q(task)} megazoo-node \\",
        f"    {q(str(recipe_file))} \\",
        f"    --nnodes {per_group} --nproc-per-node {options.gpus_per_node} \\",
        '    --lighthouse "$MEGAZOO_LIGHTHOUSE" --resume' + sets + " &",
    ]
