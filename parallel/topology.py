"""The explicit (pp, dp, tp) device mesh every communicating piece receives.

One `Topology` is built per process, from the already-initialised default process group, over a
`torch.distributed.device_mesh.DeviceMesh` with dims ("pp", "dp", "tp"). tp is innermost, so the ranks of one
tensor-parallel group are adjacent (global ranks r, r+1, ...) and, under torchrun, share a node.

A group of one rank is stored as `None`: communication helpers treat `None` as "nothing to do", which is what
makes `Topology.solo()` (no process group at all) run the same code as a real job.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")


def default_backend(device: torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_layout(dp: int, tp: int, pp: int, world_size: int) -> None:
    """Raise a ValueError naming the fields when (dp, tp, pp) cannot tile `world_size` processes."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel.{name} = {value!r} is invalid: it must be a positive integer")
    if dp * tp * pp != world_size:
        raise ValueError(
            f"parallel layout dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} processes, but the world size is "
            f"{world_size}: start {dp * tp * pp} processes (e.g. --nproc {dp * tp * pp}) or choose dp, tp, pp "
            f"whose product is {world_size}"
        )


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the (pp, dp, tp) mesh and the process groups along each dim."""

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

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @classmethod
    def solo(cls, device: str | torch.device = "cpu") -> "Topology":
        """The single-process topology: every group is a group of one, no process group is needed."""
        return cls(device=torch.device(device))

    @classmethod
    def build(cls, dp: int, tp: int = 1, pp: int = 1, device: str | torch.device | None = None) -> "Topology":
        """Build the mesh over the default process group (which the launcher initialised)."""
        if not dist.is_initialized():
            if dp * tp * pp == 1:
                return cls.solo(device or "cpu")
            raise RuntimeError(
                f"Topology.build(dp={dp}, tp={tp}, pp={pp}) needs {dp * tp * pp} processes but no process group "
                "is initialised: launch with torchrun (megazoo train --nproc N) or call init_distributed() first"
            )
        world = dist.get_world_size()
        check_layout(dp, tp, pp, world)
        device = torch.device(device) if device is not None else backend_device()
        mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
        coords = mesh.get_coordinate()
        assert coords is not None, "this rank is not part of the mesh"
        pp_rank, dp_rank, tp_rank = coords

        def group(dim: str, size: int) -> dist.ProcessGroup | None:
            return mesh.get_group(dim) if size > 1 else None

        grid = mesh.mesh  # (pp, dp, tp) tensor of global ranks
        embedding_group = None
        if pp > 1:
            # Every rank takes part in creating every group (new_group is collective), in the same order.
            for d in range(dp):
                for t in range(tp):
                    ranks = [int(grid[0, d, t]), int(grid[pp - 1, d, t])]
                    created = dist.new_group(ranks)
                    if (d, t) == (dp_rank, tp_rank) and pp_rank in (0, pp - 1):  # members only
                        embedding_group = created
        return cls(
            dp=dp, tp=tp, pp=pp, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank, rank=dist.get_rank(),
            device=device, mesh=mesh, dp_group=group("dp", dp), tp_group=group("tp", tp), pp_group=group("pp", pp),
            pp_ranks=tuple(int(r) for r in grid[:, dp_rank, tp_rank]), embedding_group=embedding_group,
        )

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: pp {self.pp_rank}/{self.pp} dp {self.dp_rank}/{self.dp} "
                f"tp {self.tp_rank}/{self.tp} on {self.device}")


def local_device(local_rank: int = 0) -> torch.device:
    """The device of the process with this node-local rank (torchrun's LOCAL_RANK, Slurm's SLURM_LOCALID): GPU
    `local_rank` when CUDA exists, else the CPU. The caller (an entry point) reads the environment; never the
    global rank modulo the GPU count, which breaks as soon as a scheduler places ranks differently."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise ValueError(f"LOCAL_RANK = {local_rank} but this node has {count} visible GPU(s) (CUDA_VISIBLE_DEVICES): "
                         f"start at most {count} processes per node, or set CUDA_VISIBLE_DEVICES='' to run on CPU")
    return torch.device("cuda", local_rank)


def backend_device() -> torch.device:
    """The device the initialised default process group communicates on: the current GPU for NCCL (set by
    init_distributed), the CPU for gloo, even when CUDA exists (gloo tests must not push CUDA tensors)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(rank: int, world_size: int, store: dist.Store | None = None, *, local_rank: int = 0,
                     device: str | torch.device | None = None, timeout_s: float = 600.0,
                     init_method: str | None = None) -> None:
    """Initialise the default process group with the backend that fits the device.

    The launcher (torchrun entry point or the test harness) calls this; library code never does. The device is
    `device`, or `local_device(local_rank)`: NCCL on a GPU (selected with set_device BEFORE the group exists and
    passed as device_id, so NCCL binds each rank to its own GPU), gloo on the CPU. `timeout_s` bounds every
    collective, so a dead or diverged rank ends the job with an error naming the operation instead of a silent
    hang.
    """
    dev = torch.device(device) if device is not None else local_device(local_rank)
    kwargs = dict(backend=default_backend(dev), rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=timeout_s))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    if store is not None:
        kwargs["store"] = store
    elif init_method is not None:
        kwargs["init_method"] = init_method
    dist.init_process_group(**kwargs)
