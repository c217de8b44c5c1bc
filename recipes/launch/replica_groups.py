"""`megazoo launch` with `[fault_tolerance]`: replica groups across nodes, and the torchft lighthouse they share.

A fault-tolerant job is `replica_groups` independent torchrun jobs (one per group: its own c10d rendezvous, its own
`--max-restarts`, so a failed group restarts alone while the others train on) and one lighthouse (torchft's quorum
server) that every group's workers reach at a known address:

    megazoo launch RECIPE --lighthouse-only --lighthouse-port 29510      # on one machine: prints its address
    # on each node of group G (its nodes numbered 0 .. M-1, M = nodes / replica_groups, rendezvous on its node 0):
    megazoo launch RECIPE --replica-group G --nnodes M --node-rank R --master GROUPHEAD:29500 \\
        --lighthouse http://LIGHTHOUSEHOST:29510

The Slurm script (slurm.py) and the Kubernetes JobSet (kubernetes.py) do exactly this: they start the lighthouse
first, name its address, and start each group's nodes with these flags.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import replace

from megazoo.parallel.fault_tolerance.config import LIGHTHOUSE_ADDRESS
from megazoo.recipes.config import Recipe, RecipeError
from megazoo.workers.replica_groups import GROUP_ENV, LIGHTHOUSE_ENV, Lighthouse, LighthouseSettings

LIGHTHOUSE_PORT = 29510  # torchft's own default port for its lighthouse


def group_recipe(recipe: Recipe) -> Recipe:
    """The layout one replica group's torchrun runs: dp / replica_groups (tp, pp, cp whole inside the group)."""
    par, groups = recipe.parallel, recipe.fault_tolerance.replica_groups
    return replace(recipe, parallel=replace(par, dp=par.dp // groups))


def nodes_per_group(recipe: Recipe, nodes: int) -> int:
    """Nodes of each replica group when the whole job has `nodes`; RecipeError naming the values when the groups
    cannot each have whole nodes (a group's failure must not take another group's ranks with its node)."""
    groups = recipe.fault_tolerance.replica_groups
    if nodes % groups:
        valid = [n for n in range(groups, 4 * groups + 1, groups)]
        raise RecipeError(f"--nodes {nodes} cannot be split into fault_tolerance.replica_groups = {groups} groups of "
                          f"whole nodes; valid: a multiple of {groups}, e.g. {', '.join(map(str, valid))}")
    return nodes // groups


def node_group(recipe: Recipe, args: argparse.Namespace) -> tuple[Recipe, dict[str, str], list[str]]:
    """For one node of a fault-tolerant job: (the recipe as its group runs it, the environment its workers get,
    torchrun's extra flags). Checks --replica-group and the lighthouse's address (RecipeError naming them)."""
    ft = recipe.fault_tolerance
    if args.replica_group is None:
        raise RecipeError(f"fault_tolerance.enabled = true: each node belongs to one of the {ft.replica_groups} "
                          "replica groups: give --replica-group G (0 .. "
                          f"{ft.replica_groups - 1}); --nnodes and --node-rank then count that group's nodes")
    if not 0 <= args.replica_group < ft.replica_groups:
        raise RecipeError(f"--replica-group {args.replica_group} is invalid; valid: 0 .. {ft.replica_groups - 1} "
                          "(fault_tolerance.replica_groups)")
    address = args.lighthouse or ft.lighthouse
    if not address:
        raise RecipeError("fault_tolerance across nodes needs the lighthouse's address: give --lighthouse "
                          "http://HOST:PORT (start one with `megazoo launch RECIPE --lighthouse-only`; the Slurm "
                          "script and the Kubernetes manifest start one) or set fault_tolerance.lighthouse")
    if not LIGHTHOUSE_ADDRESS.match(address):
        raise RecipeError(f"--lighthouse {address!r} is invalid; valid: http://HOST:PORT of a torchft lighthouse")
    env = {GROUP_ENV: str(args.replica_group), LIGHTHOUSE_ENV: address}
    # torchrun restarts the group's workers on every node of the group when one fails; the workers see
    # TORCHELASTIC_RESTART_COUNT > 0 and heal from a live group (recipes/training/replicated.replica_setup)
    return group_recipe(recipe), env, ["--max-restarts", str(ft.max_group_restarts)]


def lighthouse_settings(recipe: Recipe, port: int = 0) -> LighthouseSettings:
    ft = recipe.fault_tolerance
    return LighthouseSettings(ft.min_replicas, round(ft.join_timeout_s * 1000), round(ft.heartbeat_timeout_s * 1000),
                              port=port)


def serve_lighthouse(recipe: Recipe, port: int) -> int:
    """`megazoo launch RECIPE --lighthouse-only`: run the recipe's lighthouse on `port` until SIGTERM / SIGINT."""
    if not recipe.fault_tolerance.enabled:
        raise RecipeError("--lighthouse-only serves a fault-tolerant recipe's lighthouse: set "
                          "fault_tolerance.enabled = true (--set fault_tolerance.enabled=true)")
    if not 0 <= port < 65536:
        raise RecipeError(f"--lighthouse-port {port} is invalid; valid: 1 .. 65535 (0: any free port)")
    # The handlers go in before the address is printed: whoever reads it may stop us at once, and a SIGTERM that
    # met the default handler would end this process by the signal (-15), not stop the lighthouse and exit 143.
    stopped: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopped.append(signum))
    house = Lighthouse(lighthouse_settings(recipe, port))
    print(f"megazoo: torchft lighthouse at {house.address} (pid {house.proc.pid}); start each replica group's nodes "
          f"with --lighthouse {house.address}", file=sys.stderr, flush=True)
    print(house.address, flush=True)
    try:
        while house.alive() and not stopped:
            time.sleep(0.2)  # a signal ends the sleep early
    finally:
        code = house.proc.poll()
        house.stop()
    if stopped:
        return 128 + stopped[0]
    print(f"megazoo: error: the torchft lighthouse exited ({code})", file=sys.stderr)
    return 1
