"""`megazoo launch --kubernetes`: the recipe's layout as a JobSet manifest (jobset.x-k8s.io/v1alpha2), with a
fault-tolerant recipe's torchft lighthouse as a Service.

Why JobSet and not Kubeflow's PyTorchJob: a fault-tolerant run is `replica_groups` independent torch.distributed
worlds plus one lighthouse, and each world must fail and restart alone. PyTorchJob describes one world (one
Master + Workers set, one rendezvous, one restart policy for all of it), so it would take one PyTorchJob per group
and a separate Deployment for the lighthouse, with nothing tying them together. JobSet describes exactly our
shape in one object: a replicated Job per group (`replicas: replica_groups`, each an Indexed Job of the group's
nodes, so a pod knows its group from the job index and its node rank from the completion index, and the
group's pod 0 has a stable DNS name for the rendezvous), a one-pod Job for the lighthouse, a success policy of
"any group finished" and no JobSet-wide restart (a group restarts inside its own Job). It is also what
Kubernetes' own batch working group maintains for multi-node training, needs no training operator installed,
and runs a plain `megazoo launch` per pod.

Restarts: a worker process that dies is restarted by the pod's torchrun (--max-restarts =
fault_tolerance.max_group_restarts) on every node of its group; a pod that dies (its node lost) is replaced by its
Job at the same index (backoffLimit = max_group_restarts per pod) and joins its group's rendezvous again. Either
way the group heals from a live group. A lighthouse pod that dies is restarted in place (restartPolicy
OnFailure) behind the same Service; the groups then take the normal restart path (each saves, exits, is
restarted with --resume). Without [fault_tolerance] the manifest is one Indexed Job of all nodes.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath

from megazoo.recipes.config import Recipe, RecipeError

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
RDZV_PORT = 29500


@dataclass(frozen=True)
class KubernetesOptions:
    nodes: int
    gpus_per_node: int
    image: str
    pvc: str
    mount_path: str = "/shared"
    name: str = "megazoo"
    namespace: str | None = None
    lighthouse_port: int = 29510


def _check(recipe: Recipe, options: KubernetesOptions) -> None:
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", options.name):
        raise RecipeError(f"--job-name {options.name!r} is invalid for Kubernetes: lower-case letters, digits and "
                          "'-', starting and ending with a letter or digit, at most 40 characters")
    if not options.image:
        raise RecipeError("--kubernetes needs --image IMAGE: a container image that holds megazoo and the recipe")
    if not options.pvc:
        raise RecipeError("--kubernetes needs --pvc CLAIM: a ReadWriteMany volume claim every pod mounts (run.dir "
                          "must be on storage every node shares: checkpoints, metrics, each group's folder)")
    mount, run_dir = PurePosixPath(options.mount_path), PurePosixPath(recipe.run.dir)
    if not run_dir.is_absolute() or mount not in run_dir.parents:
        raise RecipeError(f"run.dir {recipe.run.dir} is not on the shared volume mounted at {mount}: set run.dir "
                          f"to a path under it, e.g. --set run.dir={mount}/runs/{run_dir.name or 'run'}")


def _index_env() -> list[dict]:
    """A pod's group (the JobSet's job index) and its node within the group (the Indexed Job's completion index)."""
    def annotation(name: str, key: str) -> dict:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}}
    return [annotation("JOB_INDEX", "jobset.sigs.k8s.io/job-index"),
            annotation("NODE_RANK", "batch.kubernetes.io/job-completion-index")]


def _pod(options: KubernetesOptions, container: dict, restart: str) -> dict:
    return {"spec": {"restartPolicy": restart, "subdomain": options.name,
                     "containers": [{"image": options.image, **container,
                                     "volumeMounts": [{"name": "shared", "mountPath": options.mount_path}]}],
                     "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": options.pvc}}]}}


def render_manifest(recipe: Recipe, recipe_path: str, overrides: list[str], options: KubernetesOptions) -> list[dict]:
    """The manifest's objects (a Service for the lighthouse when fault-tolerant, then the JobSet). The caller has
    checked nodes x GPUs = the recipe's layout."""
    _check(recipe, options)
    ft, name, q = recipe.fault_tolerance, options.name, shlex.quote
    groups = ft.replica_groups if ft.enabled else 1
    if options.nodes % groups:
        from megazoo.recipes.launch.replica_groups import nodes_per_group
        nodes_per_group(recipe, options.nodes)  # raises, naming the valid node counts
    per_group = options.nodes // groups
    sets = "".join(f" --set {q(s)}" for s in overrides)
    worker = "group" if ft.enabled else "node"
    launch = (f"exec megazoo launch {q(recipe_path)} --nnodes {per_group} --node-rank \"$NODE_RANK\" "
              f"--nproc-per-node {options.gpus_per_node} --resume{sets} "
              f"--master \"{name}-{worker}-$JOB_INDEX-0.{name}:{RDZV_PORT}\" --rdzv-id \"{name}-$JOB_INDEX\"")
    env = _index_env()
    objects: list[dict] = []
    replicated = []
    if ft.enabled:
        lighthouse = f"http://{name}-lighthouse:{options.lighthouse_port}"
        launch += f" --replica-group \"$JOB_INDEX\" --lighthouse {lighthouse}"
        # torchft's quorum hands each group the others' manager addresses (host names): the pod's full name
        env.append({"name": "MEGAZOO_FT_HOSTNAME", "value": f"$(POD_NAME).{name}"})
        env.insert(0, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        objects.append({"apiVersion": "v1", "kind": "Service",
                        "metadata": {"name": f"{name}-lighthouse", **_namespace(options)},
                        "spec": {"selector": {"jobset.sigs.k8s.io/jobset-name": name,
                                              "jobset.sigs.k8s.io/replicatedjob-name": "lighthouse"},
                                 "ports": [{"name": "quorum", "port": options.lighthouse_port,
                                            "targetPort": options.lighthouse_port}]}})
        serve = {"name": "lighthouse", "command": ["megazoo", "launch", recipe_path, "--lighthouse-only",
                                                   "--lighthouse-port", str(options.lighthouse_port),
                                                   *[a for s in overrides for a in ("--set", s)]],
                 "ports": [{"containerPort": options.lighthouse_port}]}
        replicated.append({"name": "lighthouse", "replicas": 1,
                           "template": {"spec": {"parallelism": 1, "completions": 1,
                                                 "backoffLimit": ft.max_group_restarts,
                                                 "template": _pod(options, serve, "OnFailure")}}})
    container = {"name": "megazoo", "command": ["bash", "-c", launch], "env": env,
                 "ports": [{"containerPort": RDZV_PORT}],
                 "resources": {"limits": {"nvidia.com/gpu": options.gpus_per_node}}}
    restarts = ft.max_group_restarts if ft.enabled else 0
    replicated.append({"name": worker, "replicas": groups,
                       "template": {"spec": {"completionMode": "Indexed", "parallelism": per_group,
                                             "completions": per_group, "backoffLimit": restarts * per_group,
                                             "template": _pod(options, container, "Never")}}})
    spec: dict = {"network": {"enableDNSHostnames": True, "subdomain": name},
                  "failurePolicy": {"maxRestarts": 0},  # a group restarts inside its Job, never all of them
                  "replicatedJobs": replicated}
    if ft.enabled:  # done once one group has trained to the end (as megazoo train's launcher)
        spec["successPolicy"] = {"operator": "Any", "targetReplicatedJobs": [worker]}
    objects.append({"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": {"name": name, **_namespace(options)},
                    "spec": spec})
    return objects


def _namespace(options: KubernetesOptions) -> dict:
    return {"namespace": options.namespace} if options.namespace else {}


def render_yaml(objects: list[dict]) -> str:
    import yaml  # PyYAML (a dependency): only when a manifest is written
    header = "# Written by `megazoo launch --kubernetes`; apply with kubectl apply -f (JobSet controller required)\n"
    return header + yaml.safe_dump_all(objects, sort_keys=False)
