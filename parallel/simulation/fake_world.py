"""A rank of a world that is not there: torch's fake process group and fake tensors, and what a step does in it.

The dry run (recipes/dry_run/run.py) runs the real training step as rank r of a recipe's full world size on one
CPU: collectives and point-to-point ops of the fake process group return at once, and fake tensors carry shape,
dtype and device but no storage, so a 1T-parameter stage costs no memory. Every torch-internal import the dry
run needs lives in this file (a torch upgrade touches only it):

    torch.testing._internal.distributed.fake_pg   FakeStore + the "fake" backend (registered by importing it)
    torch._subclasses.fake_tensor                 FakeTensorMode
    torch.distributed._tools.mem_tracker          MemTracker: bytes alive per category, and their peak
    torch.utils.flop_counter                      FlopCounterMode (public), plus a formula for CPU SDPA, and
                                                  its module tracker swapped out (it held activations)

`StepRecorder` is used by the real (gloo) run too, so both runs are measured by the same code: it records every
c10d collective and point-to-point op as (op, group size, bytes), and, under fake tensors, answers a host read
(`.item()`, `.tolist()`: aten._local_scalar_dense, which fake tensors cannot answer) with a placeholder 0 and
records where it happened, so the report can say which value was made up.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

C10D_OPS = {  # the dispatcher's c10d op -> (our name, which argument holds the bytes that count)
    "allreduce_": "all_reduce", "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather", "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all", "broadcast_": "broadcast", "reduce_": "reduce", "send": "send", "recv_": "recv",
    "recv_any_source_": "recv", "barrier": "barrier", "gather_": "gather", "scatter_": "scatter",
}


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """The default process group as rank `rank` of `world_size`, with the fake backend: every collective
    returns at once (with the tensors unchanged); new_group and DeviceMesh work as in a real job."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process: the dry run needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_tensors():
    """Tensors created inside have shape, dtype and device but no storage (FakeTensorMode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _group(obj) -> tuple[int, str]:
    """(size, description) of the ProcessGroup a c10d op received (a ScriptObject wrapping it): DeviceMesh
    describes its groups as "mesh_dp", "mesh_tp", "mesh_pp"."""
    try:
        pg = dist.ProcessGroup.unbox(obj)
    except (AttributeError, RuntimeError, TypeError):
        pg = obj
    return pg.size(), getattr(pg, "group_desc", "")


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


@dataclass
class StepRecorder(TorchDispatchMode):
    """Records what a step sends and reads. Collectives: (op, group size) -> [count, bytes], where bytes is the
    size of the tensor the op communicates: the input of an all-reduce / reduce-scatter / send, the output of an
    all-gather / recv (the bytes each rank holds of the collective, not the ring's traffic). With `placeholders`
    a host read returns 0 instead of raising, and its call site is recorded in `host_reads`."""

    placeholders: bool = False
    collectives: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    trace: list[tuple[str, int, int]] = field(default_factory=list)  # in order: (op, group size, bytes)
    host_reads: Counter = field(default_factory=Counter)  # "file:line (function)" -> count
    by_group: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (op, group desc) -> [count, bytes]
    # Copies between the host and a device: "host_to_device" / "device_to_host" -> [count, bytes, blocking count]
    # (blocking: without non_blocking=True, so the host waits for the copy; a device-to-host one waits for the
    # device's queue too). Only a CUDA step has any: on the CPU dry run every tensor is on the host.
    copies: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname in C10D_OPS:
            self._record(C10D_OPS[func._opname], args)
        elif func is torch.ops.aten._to_copy.default and "device" in kwargs:
            self._record_copy(args[0], args[0].device, torch.device(kwargs["device"]), kwargs.get("non_blocking"))
        elif func is torch.ops.aten.copy_.default:
            self._record_copy(args[1], args[1].device, args[0].device, args[2] if len(args) > 2 else
                              kwargs.get("non_blocking"))
        if self.placeholders and func is torch.ops.aten._local_scalar_dense.default:
            self.host_reads[_call_site()] += 1
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **kwargs)

    def _record(self, op: str, args) -> None:
        if op == "barrier":
            return
        size, desc = _group(next(a for a in args if isinstance(a, torch.ScriptObject)))  # the first: the group
        counted = args[1] if op in ("reduce_scatter",) and isinstance(args[1], (torch.Tensor, list)) else args[0]
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(counted))
        self.trace.append((op, size, nbytes))
        for table, key in ((self.collectives, (op, size)), (self.by_group, (op, desc))):
            entry = table.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += nbytes

    def _record_copy(self, src: torch.Tensor, source: torch.device, target: torch.device, non_blocking) -> None:
        if (source.type == "cpu") == (target.type == "cpu"):
            return
        entry = self.copies.setdefault("host_to_device" if source.type == "cpu" else "device_to_host", [0, 0, 0])
        entry[0] += 1
        entry[1] += src.numel() * src.element_size()
        entry[2] += 0 if non_blocking else 1

    def summary(self) -> list[dict]:
        return [{"op": op, "group_size": g, "count": c, "bytes": b}
                for (op, g), (c, b) in sorted(self.collectives.items())]


def _call_site() -> str:
    """The first frame outside torch: the line of our code that asked for a host value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("fake_world.py"):
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} " \
                   f"({frame.name})"
    return "unknown"


class _BackwardPhase:
    """Stands in for MemTracker's ModTracker, which it asks only whether backward is running (is_bw).

    ModTracker answers that with module hooks that put a multi-grad hook on every module's inputs: on a pipeline
    stage that receives its input (a leaf that requires grad), the hook's closure holds the leaf's gradient
    accumulator, which holds the leaf, which holds the hook - a cycle through C++ that Python's collector cannot
    break. Every received activation and its gradient then stayed alive until the step ended: one hidden state
    and its gradient more per micro-batch, on every stage but the first (gpt-1t's last stage measured +41%).
    The autograd engine knows without hooks: a graph task is running exactly while backward runs."""

    parents: frozenset = frozenset()

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class MemoryTracker:
    """Bytes of live tensor storage on this rank (torch's MemTracker), by category, and their peak.

    Enter it before the model is built: every storage created inside is counted (ZeRO's flat buffers, fp32
    masters, bucket buffers, activations). `label(params=..., grads=..., optimizer=...)` then names what the
    setup created: storages of those tensors become parameters / gradients / optimizer state, everything else
    created so far becomes "other", and the peak starts from there. During the step new storages are activations
    (forward), temporaries (backward, recomputation included) or optimizer state (inside a torch Optimizer's
    step), as MemTracker classifies them: the categories are its heuristics; the total is the figure to use.
    Gradients created during the step (ZeRO-3's owned gradients: the first reduce-scatter of a step creates them,
    or its pooled output becomes one) are named by `label(later_grads=f)`: whenever a new peak is recorded, the
    live storages of the tensors f() returns are gradients first (a relabelling moves bytes between categories,
    never the total)."""

    def __init__(self, exclude_optimizer: bool = False):
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

        self._later_grads: Callable[[], list[torch.Tensor]] | None = None
        relabel = self._relabel_later_grads

        class StepMemTracker(MemTracker):
            def _update_peak_stats(self, peak_state):
                # The device's peak: with `exclude_optimizer` (ZeRO-Offload) optimizer state is host memory.
                used = {dev: snap["Total"] - (snap.get(_MemRefType.OPT, 0) if exclude_optimizer else 0)
                        for dev, snap in self._curr_mem_snap.items()}
                higher = [dev for dev, n in used.items() if n > self._peak_mem.get(dev, 0)]
                if higher:
                    relabel()  # name the gradients created since, before the split is kept
                for dev in higher:
                    self._peak_mem[dev] = used[dev]
                    self._peak_mem_snap[dev] = dict(self._curr_mem_snap[dev])

            # No per-module statistics: they forbid calling a module twice per step (every micro-batch does)
            # and cost a snapshot copy per call. Storages are counted from their creation; recomputation under
            # activation checkpointing runs inside backward and counts as temporary.
            def _pre_fw_hook(self, module, inputs):
                pass

            def _post_fw_hook(self, module, inputs, outputs):
                pass

            def _pre_bw_hook(self, module, args):
                pass

            def _post_bw_hook(self, module, args):
                pass

        tracker = StepMemTracker()
        tracker._mod_tracker = _BackwardPhase()
        self._tracker, self._kind = tracker, _MemRefType

    def __enter__(self):
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc):
        self._tracker.__exit__(*exc)

    def label(self, *, params=(), grads=(), optimizer=(), later_grads=None) -> None:
        """`later_grads`: a function returning the gradients as they are now, some created during the step."""
        t, kind = self._tracker, self._kind
        self._later_grads = later_grads
        for winfo, _ in list(t._WINFO.values()):  # setup's allocations: "other" unless named below
            if winfo.reftype in (kind.ACT, kind.TEMP):
                old, winfo.reftype = winfo.reftype, kind.OTH
                t._update_snap(_update_type("REF"), winfo, old_reftype=old)
        # Later wins: stage 0's optimizer holds the parameters themselves.
        for tensors, reftype in ((optimizer, kind.OPT), (grads, kind.GRAD), (params, kind.PARAM)):
            for x in tensors:
                if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes() > 0:
                    t._update_and_maybe_create_winfos(x, reftype)
        # The peak starts here, from the labelled setup (the setup's own transients are not counted).
        t._peak_mem, t._peak_mem_snap = {}, {}
        t._update_peak_stats(None)

    def _relabel_later_grads(self) -> None:
        """The tracked storages of label(later_grads=f)'s f() become gradients (untracked ones stay so)."""
        if self._later_grads is None:
            return
        t, grad = self._tracker, self._kind.GRAD
        for x in self._later_grads():
            winfo = t._WINFO.get(x.untyped_storage(), (None, None))[0] if isinstance(x, torch.Tensor) else None
            if winfo is not None and winfo.reftype != grad:
                old, winfo.reftype = winfo.reftype, grad
                t._update_snap(_update_type("REF"), winfo, old_reftype=old)

    def _snapshot(self, which: str, device: torch.device | None = None) -> dict[str, int]:
        names = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Activation": "activations",
                 "Temp": "temporaries", "Buffer": "other", "Other": "other"}
        out = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "temporaries": 0, "other": 0,
               "total": 0}
        for dev, snap in self._tracker.get_tracker_snapshot(which).items():
            if device is not None and torch.device(dev).type != device.type:  # one device of each type per rank
                continue
            for key, value in snap.items():
                name = names.get(getattr(key, "value", key))
                if name is not None:
                    out[name] += value
            out["total"] += snap.get("Total", 0)
        return out

    def peak(self, device: torch.device | None = None) -> dict[str, int]:
        """The peak by category: of `device` alone, or (None) each device's own peak, added up - which is what a
        one-device (CPU) run has, and not a moment of a GPU run that also holds host memory."""
        return self._snapshot("peak", device)

    def current(self) -> dict[str, int]:
        return self._snapshot("current")


def _update_type(name: str):
    from torch.distributed._tools.mem_tracker import _UpdateType

    return getattr(_UpdateType, name)


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                             **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch's grouped matmul (the MoE experts, models/moe/experts.py), which FlopCounterMode has no formula for:
    2 x the rows x the contraction x the columns, whichever operand the groups split (forward: a (N, K) by b (G, K,
    M) at offsets over N; the weight gradient: a (K, N) by b (N, M) at offsets over N); both 3-D: per group."""
    groups = a_shape[0] if len(a_shape) == 3 and len(b_shape) == 3 else 1
    return 2 * groups * a_shape[-2] * a_shape[-1] * b_shape[-1]


class _GlobalOnly:
    """Stands in for FlopCounterMode's ModuleTracker: every FLOP goes to "Global", no module is tracked.

    Why: ModuleTracker registers a multi-grad hook on every module's inputs and outputs, forward and
    recomputation alike, and keeps each handle until the counter exits; the handles keep the autograd nodes, and
    so the tensors they saved, alive. Under activation checkpointing that held every block's recomputed
    activations to the end of backward: T-NLG 17B's rank 0 measured +1.1 GB per block (111 GB at 78 blocks)
    with the counter on and 0.3 GB per block (params, gradients, checkpoints: the planner's figure) without it,
    the same under MemTracker and under a count of live storages, fake or real."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def flop_counter() -> FlopCounterMode:
    """FlopCounterMode that also counts the CPU flash-attention kernels (torch registers formulas only for the
    CUDA ones, so SDPA on CPU would count 0): the same 4 b h s^2 d forward / 2.5x backward formulas. It counts
    the total only (no per-module table), so measuring FLOPs holds no memory (_GlobalOnly)."""
    aten, mapping = torch.ops.aten, {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flops
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_sdpa_backward_flops
    if hasattr(aten, "_grouped_mm"):
        mapping[aten._grouped_mm] = _grouped_mm_flops
    counter = FlopCounterMode(display=False, custom_mapping=mapping)
    if not hasattr(counter, "mod_tracker") or not isinstance(getattr(counter, "flop_registry", None), dict):
        # a torch upgrade moved them: fail loudly, not hold memory silently
        raise RuntimeError("FlopCounterMode has no mod_tracker / flop_registry: update "
                           "parallel/simulation/fake_world.flop_counter")
    counter.mod_tracker = _GlobalOnly()
    counter.flop_registry = _RunWhole(counter.flop_registry)
    return counter


def has_own_kernel(func) -> bool:
    """Whether an aten op has a kernel of its own (CPU or CUDA), which eager mode runs in one piece."""
    return isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" and any(
        torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key) for key in ("CPU", "CUDA"))


class _RunWhole(dict):
    """FlopCounterMode's formula table, whose membership test also says yes for an op with a kernel of its own.

    Why: the counter runs an op it has no formula for as its CompositeImplicitAutograd decomposition when there is
    one (`func not in flop_registry` -> `func.decompose`), which eager mode never does for an op with its own
    kernel, and a decomposition holds what the kernel does not: aten.silu_backward decomposed (math_silu_backward:
    sigmoid, 1 - sigmoid, two products, a sum) keeps 5 temporaries of its input's size alive at once beside the
    fused kernel's one output. In the experts' SwiGLU backward that was 8 rows x moe_d_ff alive in Mixtral's
    dry run (+25% over the planner on mixtral-8x7b-ft, +6..9% on mixtral-8x22b). Ops without a kernel (aten.to's
    overloads, promote_types) still decompose; formulas are still looked up by overload packet."""

    def __contains__(self, func) -> bool:
        return super().__contains__(func) or has_own_kernel(func)


def memory_key(t: torch.Tensor) -> tuple[int, int]:
    """Where `t`'s data starts: (its storage, element offset). Stands in for data_ptr(), which reads the offset
    alone for a fake tensor (no storage, so every fake tensor's address starts at 0) and would make two
    different fake buffers look like one."""
    return t.untyped_storage()._cdata, t.storage_offset()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b start at the same element of the same storage (real or fake tensors)."""
    return memory_key(a) == memory_key(b)


def has_values(t: torch.Tensor) -> bool:
    """False for a fake tensor (shape, dtype and device only): filling it with initial values is work that
    produces nothing - the dry run's weights have no values, and its step never reads one."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor)
