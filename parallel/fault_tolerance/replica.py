"""One replica group's link to the others, on torchft (the engine: its Manager, lighthouse quorum, fault-tolerant
process group and checkpoint transport; megazoo adds none of its own).

A replica group is one torch.distributed job (its ranks: dp / replica_groups x tp x pp x cp, ZeRO inside it); the
groups together are HSDP's replica dimension. Per optimizer step, on every rank of every live group:

  quorum       `begin_step()`: torchft's `Manager.start_quorum` (synchronous) asks the lighthouse which groups are
               alive; a group whose step is behind the quorum's (a restarted one) receives the current state from a
               live group through torchft's checkpoint transport (HTTP) and loads it before its forward: `HealState`
               (below) is every ZeRO state view (parameters, fp32 masters, Adam moments: the same views checkpoints
               use), the optimizer's update count, the loss scaler and every RNG stream the step draws from.
  reduce       `reduce_gradients(grads)` (called by parallel/zero/interface.optimizer_step after the group's own
               reduction): each of this rank's gradient tensors (ZeRO-0: the full flat buffers, ZeRO-1/2/3: the owned
               chunks) is all-reduced (average over the live groups) with the same rank of every other live group
               through torchft's fault-tolerant gloo / NCCL group. A failed peer makes the all-reduce fail quietly:
               the step is not committed, and the next quorum goes on without it.
  commit       `should_commit()`: torchft's vote inside the group; only a committed step updates parameters.

Collectives per step across groups: one all-reduce per gradient tensor (the bytes of this rank's gradient shard),
plus the quorum and commit RPCs; a heal moves one full copy of a group rank's state (parameters + masters +
moments) from a live peer.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from megazoo.parallel import accelerator
from megazoo.parallel.checkpoint.views import optimizer_steps, set_optimizer_steps
from megazoo.parallel.fault_tolerance.config import FaultToleranceConfig
from megazoo.parallel.topology import Topology


@dataclass
class HealState:
    """What a live group sends a healing one, so that the healed group's next step is the one it would have run had
    it never failed: the ZeRO optimizer's state views (in their fixed order, named, so a mismatch is an error, not
    silent garbage), the buffers that train without the optimizer (DeepSeek-V3's routing bias), the update count,
    the loss scaler, and every random stream the step draws from: the CPU generator, the device's (CUDA) generator
    and the tensor-parallel stream (`tp_rng`, parallel/tensor/random.py). Groups start from one seed and draw alike,
    so in a run without failures every group's streams are equal at every step: the sender's are the ones the
    healed group would have had. The data position needs nothing sent: a rank's batch at step s is a pure function
    of (seed, s, its share) (data/batches.GlobalBatchSampler), and the step is torchft's, moved by the heal."""

    zero: Any  # a ZeroOptimizer (parallel/zero/interface.py)
    scaler: Any = None  # DynamicLossScaler or None
    tp_rng: Any = None  # the model's TPRNGTracker (one per rank, shared by its chunks)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    buffers: list = field(default_factory=list)  # (name, tensor) trained outside the optimizer

    def rng_state(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":  # the device generator: dropout on CUDA tensors draws from it
            state["cuda"] = accelerator.rng_state(self.device)
        if self.tp_rng is not None:
            state["tp"] = self.tp_rng.get_state()
        return state

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if self.device.type == "cuda":
            accelerator.set_rng_state(state["cuda"], self.device)
        if self.tp_rng is not None:
            self.tp_rng.set_state(state["tp"].clone())

    def _names(self) -> list[str]:
        return [f"{v.kind}:{v.name}:{v.start}-{v.stop}" for v in self.zero.state_views()] + \
               [f"buffer:{name}" for name, _ in self.buffers]

    def state_dict(self) -> dict:
        return {"names": self._names(),
                "tensors": [v.tensor for v in self.zero.state_views()] + [b for _, b in self.buffers],
                "optimizer_steps": optimizer_steps(self.zero.optimizer),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "rng": self.rng_state()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        names = self._names()
        if names != state["names"]:
            raise RuntimeError(f"fault_tolerance: the live group's state ({len(state['names'])} views) does not match "
                               f"this group's ({len(names)} views): the groups must run the same recipe and layout")
        targets = [v.tensor for v in self.zero.state_views()] + [b for _, b in self.buffers]
        for target, tensor in zip(targets, state["tensors"]):
            target.copy_(tensor)  # from host memory straight into the buffer: no device-side temporary
        self.zero.after_load()
        set_optimizer_steps(self.zero.optimizer, state["optimizer_steps"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.set_rng_state(state["rng"])


class LighthouseGone(RuntimeError):
    """The lighthouse cannot be reached: no quorum can form, so fault tolerance cannot go on."""


class NoLiveGroup(RuntimeError):
    """A restarted group found no live group to heal from (see `ReplicaGroup.join`)."""


class ReplicaGroup:
    """This rank's member of torchft's quorum (see the module docstring). `group` is this group's index (0 ..
    replica_groups - 1: which share of every global batch it reads); `store` the (host, port) of the group's
    TCPStore (torchrun's MASTER_ADDR / MASTER_PORT), where rank 0 publishes torchft's manager address."""

    def __init__(self, ft: FaultToleranceConfig, topo: Topology, *, group: int, lighthouse: str,
                 store: tuple[str, int], heal: HealState, replica_id: str | None = None, hostname: str | None = None):
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.ft, self.topo, self.group, self.groups = ft, topo, group, ft.replica_groups
        self.lighthouse = lighthouse
        self.heal_state = heal
        pg = (ProcessGroupNCCL if topo.device.type == "cuda" else ProcessGroupGloo)(
            timeout=timedelta(seconds=ft.timeout_s))
        self.manager = Manager(
            pg=pg, load_state_dict=heal.load_state_dict, state_dict=heal.state_dict, min_replica_size=ft.min_replicas,
            use_async_quorum=False,  # heal before the forward: a healed group takes part in the step it joins
            timeout=timedelta(seconds=ft.timeout_s), quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timedelta(seconds=ft.timeout_s), rank=topo.rank, world_size=topo.world_size,
            store_addr=store[0], store_port=store[1], lighthouse_addr=lighthouse,
            replica_id=replica_id or f"group{group}", hostname=hostname or socket.gethostname(),
            init_sync=False)  # every group initialises the same weights from the seed: no sync at step 0
        self.healed_at: int | None = None  # the step of the last heal (this group received the state)
        self.join_quorums = 0  # quorums the first join took
        self.wait_s = 0.0  # this step's time in cross-group communication: quorum, all-reduce, commit vote
        self._committed = False

    # ---- the step ------------------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """A group resumed from its own checkpoint at `step` (a whole-job restart): the quorum starts there."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self) -> int:
        """The step's quorum (may heal this group from a live one); the step number to train."""
        start = time.perf_counter()
        before = self.manager.current_step()
        try:
            self.manager.start_quorum()
            self.manager.wait_quorum()
        except Exception as err:  # the quorum RPC failed: only the lighthouse (or this group's manager) is gone
            raise LighthouseGone(f"fault_tolerance: no quorum from the lighthouse at {self.lighthouse} ({err})") \
                from err
        step = self.manager.current_step()
        if step != before:  # only a heal moves the step at a quorum (a commit moves it at should_commit)
            self.healed_at = step
        self.wait_s = time.perf_counter() - start
        return step

    def join(self, agree: Callable[[bool], bool] | None = None, *, restarted: bool = False,
             finished: Callable[[], bool] = lambda: False) -> int:
        """The first quorum: wait (up to start_timeout_s) until every replica group has joined, so a run without
        failures trains what the same dp trains without fault tolerance; a restarted group finds the live ones at
        once and heals. The group's ranks agree on leaving through `agree` (rank 0 decides: their clocks differ).
        A `restarted` group that finds no live group by then, or sooner `finished()` (the run is over), raises
        NoLiveGroup: it never trains alone from step 0."""
        deadline = time.monotonic() + self.ft.start_timeout_s
        self.join_quorums = 0
        while True:
            step = self.begin_step()
            self.join_quorums += 1
            live = self.manager.num_participants()
            over = restarted and live < 2 and step == 0 and finished()
            done = live >= self.groups or time.monotonic() > deadline or over
            if (agree(done) if agree is not None else done):
                if restarted and live < 2 and step == 0:
                    raise NoLiveGroup(f"fault_tolerance: restarted replica group {self.group} found no live group to "
                                      f"heal from within start_timeout_s = {self.ft.start_timeout_s:g} s (the others "
                                      "finished or are gone); it does not train alone from step 0")
                return step
            time.sleep(0.05)

    @torch.no_grad()
    def reduce_gradients(self, grads: list[torch.Tensor]) -> None:
        """Average each tensor over the live groups (torchft's all-reduce; a failure is recorded, not raised)."""
        start = time.perf_counter()
        works = [self.manager.allreduce(g) for g in grads]
        for work in works:
            work.wait()
        self.wait_s += time.perf_counter() - start

    def should_commit(self) -> bool:
        start = time.perf_counter()
        self._committed = self.manager.should_commit()
        self.wait_s += time.perf_counter() - start
        return self._committed

    # ---- what the metrics say ------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Replica groups that took part in this step's quorum."""
        return self.manager.num_participants()

    def step_metrics(self, micro_batch: int, grad_accum: int) -> dict:
        """The step's fault-tolerance fields for metrics.jsonl: how many groups were live, the global batch they
        trained (it follows the live count), whether it committed, and this group's heal."""
        live = self.live
        out = {"replica_group": self.group, "replicas_live": live, "replicas": self.groups,
               "global_batch_live": micro_batch * grad_accum * self.topo.dp * live,
               "committed": self._committed, "ft_wait_s": self.wait_s,
               "time": time.time()}  # wall clock: the groups' timelines line up (benchmarks/fault_tolerance.py)
        if self.healed_at is not None:  # and how many quorums the group went through before it was let in
            out.update(healed_at_step=self.healed_at, join_quorums=self.join_quorums)
            self.healed_at = None
        return out

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def rank0_decides(topo: Topology) -> Callable[[bool], bool]:
    """`agree` for `ReplicaGroup.join`: rank 0's verdict, broadcast over the group (one small collective)."""
    def agree(done: bool) -> bool:
        if topo.world_size == 1:
            return done
        flag = torch.tensor([1.0 if done else 0.0], device=topo.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())
    return agree
