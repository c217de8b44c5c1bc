"""The explicit (pp, dp, cp, tp) device mesh every communicating piece receives.

One `Topology` is built per process, from the already-initialised default process group, over a
`torch.distributed.device_mesh.DeviceMesh` with dims ("pp", "dp", "tp"), or ("pp", "dp", "cp", "tp") when the
sequence is split over context-parallel ranks (cp > 1). tp is innermost, so the ranks of one tensor-parallel
group are adjacent (global ranks r, r+1, ...) and, under torchrun, share a node; cp comes next, since ring and
all-to-all attention move activations every layer.

cp ranks hold the same parameters (each sees other tokens of the same samples), so gradients are reduced, and
ZeRO partitions, over the dp x cp ranks of one (pp, tp) position: `grad_group` (the dp group when cp = 1).

Nodes: `node_size` processes per node (the launcher's LOCAL_WORLD_SIZE, read by the entry point, or the
recipe's parallel.node_size; 0 = not known, every rank on one node). Ranks fill nodes in order (torchrun and
Slurm place global ranks node by node), so a node holds whole tp (x cp) groups and `dp_per_node` consecutive dp
ranks of each (pp, cp, tp) position. The dp group then splits in two: `dp_intra_group` (the dp ranks on this
node: fast links) and `dp_inter_group` (the dp ranks at this node-local position on the other nodes: the slow
network). HSDP and hpZ (parallel/zero/groups.py) shard and gather inside a node and cross nodes less.

Experts: `ep` ranks of each (pp, tp) position's dp x cp ranks split the routed experts of every MoE layer
(parallel/expert); ep is carved out of dp x cp, not a mesh dim of its own. The ep ranks are consecutive grad ranks
(ep innermost: the all-to-all of every MoE layer stays on the closest ranks), `ep_group`; the (dp x cp) / ep
ranks holding the same experts (same ep rank) form the expert-data-parallel group `edp_group`, over which expert
weights' gradients are reduced (and ZeRO partitions them); dense weights still use `grad_group`.

A group of one rank is stored as `None`: communication helpers treat `None` as "nothing to do", which is what
makes `Topology.solo()` (no process group at all) run the same code as a real job.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megazoo.parallel import accelerator
from megazoo.parallel.topology_groups import (_expert_groups, _node_dp_cp_group, _node_groups,  # noqa: F401
                                             check_expert_layout)

MESH_DIMS = ("pp", "dp", "tp")
CP_MESH_DIMS = ("pp", "dp", "cp", "tp")
CP_ATTENTION = ("all_to_all", "ring")


def default_backend(device: torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_layout(dp: int, tp: int, pp: int, world_size: int, cp: int = 1) -> None:
    """Raise a ValueError naming the fields when (dp, cp, tp, pp) cannot tile `world_size` processes."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel.{name} = {value!r} is invalid: it must be a positive integer")
    n = dp * tp * pp * cp
    if n != world_size:
        where = f"dp={dp} x tp={tp} x pp={pp}" + (f" x cp={cp}" if cp > 1 else "")
        raise ValueError(
            f"parallel layout {where} = {n} processes, but the world size is "
            f"{world_size}: start {n} processes (e.g. --nproc {n}) or choose dp, tp, pp{', cp' if cp > 1 else ''} "
            f"whose product is {world_size}"
        )


def check_node_size(node_size: int, dp: int, tp: int, pp: int, world_size: int, cp: int = 1) -> int:
    """The dp ranks of one (pp, cp, tp) position that share a node, or a ValueError naming parallel.node_size
    when `node_size` processes per node cannot hold whole tp x cp groups and whole or equal parts of dp groups.
    0 means not known: one node."""
    if not isinstance(node_size, int) or node_size < 0:
        raise ValueError(f"parallel.node_size = {node_size!r} is invalid: it must be a positive integer "
                         "(processes per node), or 0 to take the launcher's local world size")
    if node_size == 0:
        return dp
    if world_size % node_size:
        raise ValueError(f"parallel.node_size = {node_size} does not divide the world size {world_size}: every "
                         f"node must hold the same number of processes (valid: a divisor of {world_size})")
    inner = tp * cp
    if node_size % inner:
        raise ValueError(f"parallel.node_size = {node_size} would split a tensor-parallel group of tp x cp = "
                         f"{inner} ranks over two nodes; valid: a multiple of {inner} that divides {world_size}")
    per_node = node_size // inner  # consecutive dp indices (pp-major) on one node
    if (per_node < dp and dp % per_node) or (per_node > dp and per_node % dp):
        raise ValueError(f"parallel.node_size = {node_size} puts {per_node} dp ranks of each tp position on a "
                         f"node, which does not split parallel.dp = {dp} evenly; valid: node sizes whose "
                         f"node_size / (tp x cp) divides dp = {dp} or is a multiple of it")
    return min(per_node, dp)


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the (pp, dp, cp, tp) mesh and the process groups along each dim."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None
    dp_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's pipeline, in stage order
    embedding_group: dist.ProcessGroup | None = None  # first + last stage of this pipeline (tied embeddings)
    cp: int = 1  # context parallelism: ranks sharing each sequence (parallel/context)
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    cp_attention: str = "all_to_all"  # how attention crosses the cp split: "all_to_all" (Ulysses) | "ring"
    dp_cp_group: dist.ProcessGroup | None = None  # dp x cp ranks of this (pp, tp) position; only set when both > 1
    # Norm, dropout and residual regions hold s / tp positions per tp rank (parallel/tensor/sequence.py)
    sequence_parallel: bool = False
    node_size: int = 0  # processes per node; 0: not known (one node)
    dp_per_node: int = 0  # dp ranks of this (pp, cp, tp) position on one node; 0: all dp (one node)
    dp_intra_group: dist.ProcessGroup | None = None  # this node's dp ranks (dp_group when dp fits in a node)
    dp_inter_group: dist.ProcessGroup | None = None  # the same node-local dp position on every node
    # this node's dp x cp ranks of this (pp, tp) position: HSDP's and hpZ's node group (dp_intra_group if cp = 1)
    dp_cp_intra_group: dist.ProcessGroup | None = None
    ep: int = 1  # expert parallelism: ranks of grad_group splitting the routed experts (parallel/expert)
    ep_group: dist.ProcessGroup | None = None  # consecutive grad ranks: ep rank = grad_rank % ep
    edp_group: dist.ProcessGroup | None = None  # the (dp x cp) / ep ranks holding the same experts

    @property
    def ep_rank(self) -> int:
        return self.grad_rank % self.ep

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the grad ranks holding the same experts."""
        return self.grad_size // self.ep

    @property
    def edp_rank(self) -> int:
        return self.grad_rank // self.ep

    @property
    def dp_nodes(self) -> int:
        """How many nodes one dp group spans."""
        return self.dp // (self.dp_per_node or self.dp)

    @property
    def dp_intra_rank(self) -> int:
        return self.dp_rank % (self.dp_per_node or self.dp)

    @property
    def dp_inter_rank(self) -> int:
        return self.dp_rank // (self.dp_per_node or self.dp)

    @property
    def dp_cp_intra_rank(self) -> int:
        """The rank in dp_cp_intra_group (dp-major, as the mesh)."""
        return self.dp_intra_rank * self.cp + self.cp_rank

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def grad_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same parameters, over which gradients are averaged (and ZeRO partitions):
        dp x cp. The dp group when cp = 1."""
        if self.cp == 1:
            return self.dp_group
        return self.cp_group if self.dp == 1 else self.dp_cp_group

    @property
    def grad_size(self) -> int:
        return self.dp * self.cp

    @property
    def grad_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank  # the rank in grad_group (dp-major, as the mesh)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @classmethod
    def solo(cls, device: str | torch.device = "cpu") -> "Topology":
        """The single-process topology: every group is a group of one, no process group is needed."""
        return cls(device=torch.device(device), node_size=1)

    @classmethod
    def of(cls, layout, device: str | torch.device | None = None, *, node_size: int | None = None) -> "Topology":
        """`build` from a layout description (a recipe's [parallel]: dp, tp, pp, cp, cp_attention,
        sequence_parallel, node_size); the one place that maps its fields onto the mesh. `node_size`: the
        launcher's processes per node, when the layout leaves it open (0)."""
        return cls.build(layout.dp, layout.tp, layout.pp, device, cp=layout.cp, cp_attention=layout.cp_attention,
                         sequence_parallel=layout.sequence_parallel,
                         node_size=layout.node_size if node_size is None else node_size, ep=getattr(layout, "ep", 1))

    @staticmethod
    def rank_at(layout, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank `of(layout)` places at mesh coordinate (pp, dp, cp, tp): init_device_mesh numbers
        the (pp, dp, cp, tp) grid row-major, tp innermost (the dry run picks its roles' ranks with it)."""
        return ((pp * layout.dp + dp) * layout.cp + cp) * layout.tp + tp

    @classmethod
    def build(cls, dp: int, tp: int = 1, pp: int = 1, device: str | torch.device | None = None, *, cp: int = 1,
              cp_attention: str = "all_to_all", sequence_parallel: bool = False,
              node_size: int = 0, ep: int = 1) -> "Topology":
        """Build the mesh over the default process group (which the launcher initialised). `node_size`:
        processes per node (the entry point passes LOCAL_WORLD_SIZE or the recipe's parallel.node_size). `ep`:
        expert-parallel ranks carved out of dp x cp (check_expert_layout)."""
        check_expert_layout(ep, dp, cp)
        if cp_attention not in CP_ATTENTION:
            raise ValueError(f"parallel.cp_attention = {cp_attention!r} is invalid; valid: {', '.join(CP_ATTENTION)}")
        if sequence_parallel and tp == 1:
            raise ValueError("parallel.sequence_parallel = true needs parallel.tp >= 2 (it splits the sequence over "
                             "the tensor-parallel group); valid: set parallel.tp >= 2 or sequence_parallel = false")
        if not dist.is_initialized():
            if dp * tp * pp * cp == 1:
                return cls.solo(device or "cpu")
            raise RuntimeError(
                f"Topology.build(dp={dp}, tp={tp}, pp={pp}, cp={cp}) needs {dp * tp * pp * cp} processes but no "
                "process group is initialised: launch with torchrun (megazoo train --nproc N) or call "
                "init_distributed() first"
            )
        world = dist.get_world_size()
        check_layout(dp, tp, pp, world, cp)
        dp_per_node = check_node_size(node_size, dp, tp, pp, world, cp)
        device = torch.device(device) if device is not None else backend_device()
        if cp == 1:  # the 3-dim mesh exactly as before context parallelism existed
            mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
            coords = mesh.get_coordinate()
            assert coords is not None, "this rank is not part of the mesh"
            (pp_rank, dp_rank, tp_rank), cp_rank = coords, 0
        else:
            mesh = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=CP_MESH_DIMS)
            coords = mesh.get_coordinate()
            assert coords is not None, "this rank is not part of the mesh"
            pp_rank, dp_rank, cp_rank, tp_rank = coords

        def group(dim: str, size: int) -> dist.ProcessGroup | None:
            return mesh.get_group(dim) if size > 1 else None

        grid = mesh.mesh.reshape(pp, dp, cp, tp)  # global ranks
        embedding_group = dp_cp_group = None
        # Every rank takes part in creating every group (new_group is collective), in the same order.
        if pp > 1:
            for d in range(dp):
                for c in range(cp):
                    for t in range(tp):
                        created = dist.new_group([int(grid[0, d, c, t]), int(grid[pp - 1, d, c, t])])
                        if (d, c, t) == (dp_rank, cp_rank, tp_rank) and pp_rank in (0, pp - 1):  # members only
                            embedding_group = created
        if dp > 1 and cp > 1:  # gradients are averaged over dp x cp (cp ranks hold the same parameters)
            for p in range(pp):
                for t in range(tp):
                    created = dist.new_group([int(r) for r in grid[p, :, :, t].flatten()], group_desc="dp_cp")
                    if (p, t) == (pp_rank, tp_rank):
                        dp_cp_group = created
        dp_group = group("dp", dp)
        ep_group, edp_group = _expert_groups(grid, ep, (pp_rank, dp_rank, cp_rank, tp_rank))
        dp_intra, dp_inter = _node_groups(grid, dp_per_node, (pp_rank, dp_rank, cp_rank, tp_rank), dp_group)
        dp_cp_intra = dp_intra
        if cp > 1:  # a node holds whole cp groups: its dp ranks x every cp rank (= dp x cp when dp fits in it)
            dp_cp_intra = _node_dp_cp_group(grid, dp_per_node, (pp_rank, dp_rank, tp_rank), dp_cp_group,
                                            group("cp", cp))
        return cls(
            dp=dp, tp=tp, pp=pp, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank, rank=dist.get_rank(),
            device=device, mesh=mesh, dp_group=dp_group, tp_group=group("tp", tp), pp_group=group("pp", pp),
            pp_ranks=tuple(int(r) for r in grid[:, dp_rank, cp_rank, tp_rank]), embedding_group=embedding_group,
            cp=cp, cp_rank=cp_rank, cp_group=group("cp", cp), cp_attention=cp_attention, dp_cp_group=dp_cp_group,
            sequence_parallel=sequence_parallel,
            node_size=node_size, dp_per_node=dp_per_node, dp_intra_group=dp_intra, dp_inter_group=dp_inter,
            dp_cp_intra_group=dp_cp_intra,
            ep=ep, ep_group=ep_group, edp_group=edp_group,
        )

    def describe(self) -> str:
        cp = f" cp {self.cp_rank}/{self.cp} ({self.cp_attention})" if self.cp > 1 else ""
        ep = f" ep {self.ep_rank}/{self.ep}" if self.ep > 1 else ""
        return (f"rank {self.rank}/{self.world_size}: pp {self.pp_rank}/{self.pp} dp {self.dp_rank}/{self.dp}{cp}{ep} "
                f"tp {self.tp_rank}/{self.tp}{' (sequence parallel)' if self.sequence_parallel else ''} on {self.device}")



def local_device(local_rank: int = 0) -> torch.device:
    """The device of the process with this node-local rank (torchrun's LOCAL_RANK, Slurm's SLURM_LOCALID): GPU
    `local_rank` when CUDA exists, else the CPU. The caller (an entry point) reads the environment; never the
    global rank modulo the GPU count, which breaks as soon as a scheduler places ranks differently."""
    if not accelerator.cuda_available():
        return torch.device("cpu")
    count = accelerator.cuda_device_count()
    if not 0 <= local_rank < count:
        raise ValueError(f"LOCAL_RANK = {local_rank} but this node has {count} visible GPU(s) (CUDA_VISIBLE_DEVICES): "
                         f"start at most {count} processes per node, or set CUDA_VISIBLE_DEVICES='' to run on CPU")
    return torch.device("cuda", local_rank)


def backend_device() -> torch.device:
    """The device the initialised default process group communicates on: the current GPU for NCCL (set by
    init_distributed), the CPU for gloo, even when CUDA exists (gloo tests must not push CUDA tensors)."""
    if dist.get_backend() == "nccl":
        return accelerator.current_device()
    return torch.device("cpu")


def init_distributed(rank: int, world_size: int, store: dist.Store | None = None, *, local_rank: int = 0,
                     device: str | torch.device | None = None, timeout_s: float = 600.0,
                     init_method: str | None = None, check_collectives: bool = False,
                     flight_recorder: int = 0) -> None:
    """Initialise the default process group with the backend that fits the device.

    The launcher (torchrun entry point or the test harness) calls this; library code never does. The device is
    `device`, or `local_device(local_rank)`: NCCL on a GPU (selected with set_device BEFORE the group exists and
    passed as device_id, so NCCL binds each rank to its own GPU), gloo on the CPU. `timeout_s` bounds every
    collective, so a dead or diverged rank ends the job with an error naming the operation instead of a silent
    hang. `check_collectives`: every collective first compares its fingerprint across ranks, so a mismatched
    one fails at once naming both ranks and calls (parallel/collective_check.py: torch's DETAIL debug level).
    `flight_recorder` > 0: torch records each rank's last that many collectives (parallel/flight_recorder.py).
    """
    if check_collectives:
        from megazoo.parallel.collective_check import enable_collective_checks
        enable_collective_checks()
    if flight_recorder > 0:  # torch's ring of each rank's last collectives (parallel/flight_recorder.py)
        from megazoo.parallel.flight_recorder import enable_flight_recorder
        enable_flight_recorder(flight_recorder)
    dev = torch.device(device) if device is not None else local_device(local_rank)
    kwargs = dict(backend=default_backend(dev), rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=timeout_s))
    if dev.type == "cuda":
        accelerator.set_device(dev)
        kwargs["device_id"] = dev
    if store is not None:
        kwargs["store"] = store
    elif init_method is not None:
        kwargs["init_method"] = init_method
    dist.init_process_group(**kwargs)
