"""`megazoo launch`: one node of a multi-node job (torchrun, c10d rendezvous), or a Slurm sbatch script.

    # on each of N nodes (node 0's address as the rendezvous endpoint, the same --rdzv-id everywhere):
    megazoo launch RECIPE --nnodes N --node-rank R --master HOST:PORT [--nproc-per-node G] [--set k=v ...]
    # or let Slurm start them (recipes/launch/slurm.py renders the script):
    megazoo launch --slurm RECIPE --nodes N --gpus-per-node G [--partition P --time HH:MM:SS --account A --out F]
    # or a Kubernetes JobSet (recipes/launch/kubernetes.py):
    megazoo launch --kubernetes RECIPE --nodes N --gpus-per-node G --image IMG --pvc CLAIM [--out F]
    # [fault_tolerance] recipes: the lighthouse, and each node in its replica group (recipes/launch/replica_groups.py)
    megazoo launch RECIPE --lighthouse-only [--lighthouse-port 29510]
    megazoo launch RECIPE --replica-group G --nnodes M --node-rank R --master HOST:PORT --lighthouse http://H:P

The recipe is checked on the launching machine before any process starts (exit 2 naming the values): it must
resolve, and nnodes x nproc-per-node must equal dp x tp x pp. One node then runs
`python -m torch.distributed.run --nnodes N --node-rank R --nproc-per-node G --rdzv-backend c10d
--rdzv-endpoint HOST:PORT --rdzv-id ID -m megazoo.recipes.train RECIPE ...` (printed first; `--dry-run` prints
it and exits) under workers/supervisor.py's Job, as `megazoo train` does: torchrun dies with this process, a
SIGTERM / SIGINT is forwarded once to the node's workers (they finish the step, save and stop) and this process
then exits 128 + signal (143 for SIGTERM). torchrun sets RANK / LOCAL_RANK / WORLD_SIZE; with c10d the global
ranks follow the rendezvous order (torchrun ignores --node-rank), so --node-rank here names the node that owns
run.dir: node 0's launcher takes run.dir's lock (recipes/training/run_dir.py) and refuses a fresh run into a used run.dir
(--resume continues it); every node's workers are told the lock is held. run.dir must be on storage every node
shares: rank 0 (on whichever node) writes metrics.jsonl, and every rank writes its checkpoint shards there.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

from megazoo.data.published.catalog import default_folders
from megazoo.workers.supervisor import Job
from megazoo.recipes.catalog import find_recipe
from megazoo.recipes.config import Recipe, RecipeError, load_recipe
from megazoo.recipes.training.run_dir import LOCK_HELD_ENV, RunDirBusy, RunDirLock, previous_run

TRAIN_MODULE = "megazoo.recipes.train"
DUPLICATE_SIGNAL_S = 10.0  # Slurm may deliver one stop twice (to the task directly, and through srun)


def check_layout(recipe: Recipe, nnodes: int, nproc_per_node: int | None) -> int:
    """The processes per node: nproc_per_node, or dp x tp x pp / nnodes when None. Raises RecipeError naming
    the values when nnodes x nproc_per_node is not the recipe's dp x tp x pp."""
    par = recipe.parallel
    world = par.dp * par.tp * par.pp * par.cp
    cp = f" x cp {par.cp}" if par.cp > 1 else ""
    layout = f"the recipe's layout dp {par.dp} x tp {par.tp} x pp {par.pp}{cp} = {world} processes"
    if nnodes < 1:
        raise RecipeError(f"--nnodes {nnodes} is invalid: it must be a positive integer")
    if nproc_per_node is None:
        if world % nnodes:
            raise RecipeError(f"{layout} cannot be split over --nnodes {nnodes}: choose a number of nodes that "
                              f"divides {world}, or change parallel.dp / tp / pp")
        return world // nnodes
    if nproc_per_node < 1:
        raise RecipeError(f"--nproc-per-node {nproc_per_node} is invalid: it must be a positive integer")
    if nnodes * nproc_per_node != world:
        raise RecipeError(f"{layout} does not match --nnodes {nnodes} x --nproc-per-node {nproc_per_node} = "
                          f"{nnodes * nproc_per_node} processes: change the nodes or processes per node, or set "
                          f"parallel.dp / tp / pp (--set parallel.dp=...) so that dp x tp x pp = "
                          f"{nnodes * nproc_per_node}")
    node_size = getattr(recipe.parallel, "node_size", 0)
    if node_size and nnodes > 1 and node_size != nproc_per_node:  # HSDP / hpZ would split the wrong ranks
        raise RecipeError(f"parallel.node_size = {node_size} but each node starts --nproc-per-node "
                          f"{nproc_per_node} processes: set parallel.node_size = {nproc_per_node} or 0 (torchrun's "
                          "LOCAL_WORLD_SIZE)")
    return nproc_per_node


def parse_endpoint(text: str) -> tuple[str, int]:
    """HOST:PORT (HOST may be a name, an IPv4 address or a bracketed IPv6 address)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RecipeError(f"--master {text!r} is invalid: it must be HOST:PORT, e.g. node001:29500 (node 0's "
                          f"address and a free port there)")
    return host, int(port)


def torchrun_node_command(recipe: str, overrides: list[str], *, nnodes: int, node_rank: int, nproc_per_node: int,
                          master: str, rdzv_id: str, python: str = sys.executable,
                          data_dir: str | None = None, extra: list[str] = ()) -> list[str]:
    """The torchrun command for one node of a c10d-rendezvous job training `recipe` (`extra`: more torchrun
    flags, e.g. a replica group's --max-restarts)."""
    sets = [arg for text in overrides for arg in ("--set", text)]
    sets += ["--data-dir", os.path.abspath(data_dir)] if data_dir else []
    return [python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", master,
            "--rdzv-id", rdzv_id, *extra, "-m", TRAIN_MODULE, recipe, *sets]


class _NodeJob(Job):
    """A Job that takes a repeat of the same stop signal within DUPLICATE_SIGNAL_S for one stop: a preempted
    Slurm job's signal reaches the task directly and again through srun, and a second signal would kill the
    workers while they save."""

    _last: tuple[int, float] | None = None

    def _on_signal(self, signum: int, _frame) -> None:
        now = time.monotonic()
        if self._last is not None and self._last[0] == signum and now - self._last[1] < DUPLICATE_SIGNAL_S:
            return
        self._last = (signum, now)
        super()._on_signal(signum, _frame)


def _node(args: argparse.Namespace) -> int:
    if args.nnodes is None or args.node_rank is None or args.master is None:
        missing = [name for name, value in (("--nnodes", args.nnodes), ("--node-rank", args.node_rank),
                                            ("--master", args.master)) if value is None]
        print(f"megazoo: error: launching a node needs {', '.join(missing)} (or --slurm to write an sbatch "
              f"script)", file=sys.stderr)
        return 2
    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    lock = None
    env: dict[str, str] = {}
    extra: list[str] = []
    try:
        args.recipe = str(find_recipe(args.recipe))  # a file, or a shipped recipe's name (megazoo recipes)
        recipe = load_recipe(args.recipe, overrides, data_dir=args.data_dir,
                             catalog_dirs=default_folders(os.environ))
        run_dir, layout = recipe.run.dir, recipe
        if recipe.fault_tolerance.enabled:  # this node runs one replica group's share (replica_groups.py)
            from megazoo.recipes.launch.replica_groups import node_group
            layout, env, extra = node_group(recipe, args)
            run_dir = os.path.join(run_dir, f"group-{args.replica_group}")  # each group owns its folder
        nproc = check_layout(layout, args.nnodes, args.nproc_per_node)
        if not 0 <= args.node_rank < args.nnodes:
            raise RecipeError(f"--node-rank {args.node_rank} is invalid: with --nnodes {args.nnodes} it must be "
                              f"0 .. {args.nnodes - 1}")
        parse_endpoint(args.master)
        from megazoo.recipes.resolve import resolve  # torch: once the command runs, not for --help
        resolve(recipe, world_size=args.nnodes * nproc)
        command = torchrun_node_command(args.recipe, overrides, nnodes=args.nnodes, node_rank=args.node_rank,
                                        nproc_per_node=nproc, master=args.master, rdzv_id=args.rdzv_id,
                                        data_dir=args.data_dir, extra=extra)
        if args.dry_run:
            print(" ".join(command))
            return 0
        if args.node_rank == 0:  # node 0 owns run.dir: one job per run.dir, no run silently written over
            lock = RunDirLock.acquire(run_dir)
            previous = previous_run(run_dir)
            if previous and not (args.resume or recipe.checkpoint.resume):
                raise RecipeError(f"run.dir {run_dir} already holds a run ({', '.join(previous)}): continue "
                                  f"it with --resume, or choose another run.dir")
    except (RecipeError, RunDirBusy) as err:
        if lock is not None:
            lock.release()
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    processes = f"{nproc} process{'es' * (nproc > 1)}"
    print(f"megazoo: node {args.node_rank} of {args.nnodes} ({processes}, rendezvous {args.master} id "
          f"{args.rdzv_id}): {' '.join(command)}", file=sys.stderr, flush=True)
    held_by = f"node 0's launcher (pid {os.getpid()} on {socket.gethostname()})" if lock else "node 0's launcher"
    try:
        with _NodeJob({LOCK_HELD_ENV: held_by, **env}) as job:
            code = job.attempt(command)
            stopped = job.stopped_by(code)
    finally:
        if lock is not None:
            lock.release()
    if stopped is not None:
        print(f"megazoo: node {args.node_rank} stopped by {signal.Signals(stopped).name} (continue with --resume)",
              file=sys.stderr)
        return 128 + stopped
    return code


def _slurm(args: argparse.Namespace) -> int:
    from megazoo.recipes.launch.slurm import SlurmOptions, render_sbatch
    try:
        if args.nnodes is None or args.nproc_per_node is None:
            raise RecipeError("--slurm needs --nodes N and --gpus-per-node G")
        args.recipe = str(find_recipe(args.recipe))
        recipe = load_recipe(args.recipe, args.overrides, data_dir=args.data_dir,
                             catalog_dirs=default_folders(os.environ))
        check_layout(recipe, args.nnodes, args.nproc_per_node)
        from megazoo.recipes.resolve import resolve
        resolve(recipe, world_size=args.nnodes * args.nproc_per_node)
        options = SlurmOptions(nodes=args.nnodes, gpus_per_node=args.nproc_per_node, partition=args.partition,
                               time=args.time, account=args.account, job_name=args.job_name, port=args.port)
        script = render_sbatch(recipe, Path(args.recipe), list(args.overrides), options, workdir=Path.cwd(),
                               data_dir=args.data_dir)
    except RecipeError as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(script)
        return 0
    out = Path(args.out)
    out.write_text(script)
    out.chmod(0o755)
    print(f"megazoo: wrote {out} ({args.nnodes} nodes x {args.nproc_per_node} GPUs); submit it with: sbatch {out}",
          file=sys.stderr)
    return 0


def _kubernetes(args: argparse.Namespace) -> int:
    from megazoo.recipes.launch.kubernetes import KubernetesOptions, render_manifest, render_yaml
    try:
        if args.nnodes is None or args.nproc_per_node is None:
            raise RecipeError("--kubernetes needs --nodes N and --gpus-per-node G")
        path = str(find_recipe(args.recipe))
        recipe = load_recipe(path, args.overrides, data_dir=args.data_dir, catalog_dirs=default_folders(os.environ))
        check_layout(recipe, args.nnodes, args.nproc_per_node)
        from megazoo.recipes.resolve import resolve
        resolve(recipe, world_size=args.nnodes * args.nproc_per_node)
        options = KubernetesOptions(args.nnodes, args.nproc_per_node, args.image or "", args.pvc or "",
                                    args.mount_path, args.job_name or Path(path).stem.replace(".", "-").lower(),
                                    args.namespace, args.lighthouse_port)
        text = render_yaml(render_manifest(recipe, path, list(args.overrides), options))
    except RecipeError as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
        return 0
    Path(args.out).write_text(text)
    print(f"megazoo: wrote {args.out} ({args.nnodes} nodes x {args.nproc_per_node} GPUs); apply it with: "
          f"kubectl apply -f {args.out}", file=sys.stderr)
    return 0


def _lighthouse_only(args: argparse.Namespace) -> int:
    from megazoo.recipes.launch.replica_groups import serve_lighthouse
    try:
        recipe = load_recipe(str(find_recipe(args.recipe)), args.overrides, data_dir=args.data_dir,
                             catalog_dirs=default_folders(os.environ))
        return serve_lighthouse(recipe, args.lighthouse_port)
    except RecipeError as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2


def _launch(args: argparse.Namespace) -> int:
    if args.lighthouse_only:
        return _lighthouse_only(args)
    if args.kubernetes:
        return _kubernetes(args)
    return _slurm(args) if args.slurm else _node(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe file or shipped recipe name, e.g. tnlg-17b (megazoo recipes)")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="folder of the recipe's relative data paths (default: the recipe's folder)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe key (repeatable)")
    parser.add_argument("--nnodes", "--nodes", dest="nnodes", type=int, default=None, metavar="N",
                        help="number of nodes")
    parser.add_argument("--nproc-per-node", "--gpus-per-node", dest="nproc_per_node", type=int, default=None,
                        metavar="G", help="processes (GPUs) per node (default: dp x tp x pp / nodes)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest good checkpoint in run.dir (a requeued or restarted job)")
    node = parser.add_argument_group("one node (torchrun, c10d rendezvous)")
    node.add_argument("--node-rank", type=int, default=None, metavar="R", help="this node, 0 .. N-1 (node 0 "
                      "owns run.dir's lock)")
    node.add_argument("--master", default=None, metavar="HOST:PORT",
                      help="rendezvous endpoint: node 0's address and a free port there")
    node.add_argument("--rdzv-id", default="megazoo", metavar="ID",
                      help="rendezvous id, the same on every node of one job (e.g. $SLURM_JOB_ID)")
    node.add_argument("--dry-run", action="store_true", help="print this node's torchrun command and exit")
    ft = parser.add_argument_group("fault tolerance ([fault_tolerance]: replica groups on torchft)")
    ft.add_argument("--replica-group", type=int, default=None, metavar="G",
                    help="the replica group this node belongs to (--nnodes / --node-rank / --master: that group's)")
    ft.add_argument("--lighthouse", default=None, metavar="http://HOST:PORT",
                    help="the torchft lighthouse every group reaches (default: fault_tolerance.lighthouse)")
    ft.add_argument("--lighthouse-only", action="store_true",
                    help="run the recipe's torchft lighthouse here (prints its address) until stopped")
    ft.add_argument("--lighthouse-port", type=int, default=29510, help="the lighthouse's port (default 29510)")
    kube = parser.add_argument_group("Kubernetes (writes a JobSet manifest; apply it with kubectl)")
    kube.add_argument("--kubernetes", action="store_true", help="write a JobSet manifest instead of launching")
    kube.add_argument("--image", default=None, help="the container image that holds megazoo")
    kube.add_argument("--pvc", default=None, metavar="CLAIM",
                      help="a ReadWriteMany PersistentVolumeClaim every pod mounts: run.dir must be on it")
    kube.add_argument("--mount-path", default="/shared", help="where the claim is mounted (default /shared)")
    kube.add_argument("--namespace", default=None)
    slurm = parser.add_argument_group("Slurm (writes an sbatch script; submit it with sbatch)")
    slurm.add_argument("--slurm", action="store_true", help="write the sbatch script instead of launching")
    slurm.add_argument("--partition", default=None, metavar="P")
    slurm.add_argument("--time", default=None, metavar="HH:MM:SS", help="time limit of one allocation (the job "
                       "saves 120 s before it and is requeued)")
    slurm.add_argument("--account", default=None, metavar="A")
    slurm.add_argument("--job-name", default=None, metavar="NAME", help="default: the recipe's file name (Slurm, "
                       "Kubernetes)")
    slurm.add_argument("--port", type=int, default=29500, help="rendezvous port on the first node (default 29500)")
    slurm.add_argument("--out", default=None, metavar="FILE", help="write the script (Slurm) or manifest "
                       "(Kubernetes) here (default: stdout)")
    parser.set_defaults(func=_launch)


def register(subparsers) -> None:
    """Add `megazoo launch` to the `megazoo` command line."""
    parser = subparsers.add_parser("launch", help="launch one node of a multi-node job (torchrun), or write a "
                                                  "Slurm sbatch script (--slurm)")
    add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megazoo launch", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
