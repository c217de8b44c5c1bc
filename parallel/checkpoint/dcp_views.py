"""A training run's state views saved and loaded as a torch.distributed.checkpoint (DCP) checkpoint
(`checkpoint.format = "dcp"`), resharding on load through DCP's own planner.

DCP stores each tensor as rectangular chunks of its global shape, recorded in `.metadata`, and on load computes which
saved chunks overlap the chunks a rank asks for (create_read_items_for_chunk_list): that is its resharding. Our
views are flat element ranges of a tp-local tensor (ZeRO cuts parameters anywhere, and a fused QKV's tp shard is a
piece of each section), which no DTensor placement expresses, but every such range is a short list of rectangles of
the global tensor: a partial first row, a block of whole rows, a partial last row (recursively for more dims), each
split where the tp shard's sections jump. Those rectangles are what this rank writes and asks for, through DCP's
documented extension point (a SavePlanner / LoadPlanner that names its own write and read items), so the files,
the metadata, the overlap computation and the reading are torch's.

Keys are "<kind>/<global name>" ("param/blocks.0.attn.qkv.weight", "exp_avg/..."); vocabulary tensors are stored
at the real vocabulary's rows (the padding depends on tp), so the saved shapes are the model's own and any layout
(or DCP tool) reads them. A full-precision "param" view reads the "master" chunks when the checkpoint has them, as
the native format does (load.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from megazoo.parallel.checkpoint.views import StateView

SOURCES = {"param": ("param",), "master": ("master", "param"), "exp_avg": ("exp_avg",),
           "exp_avg_sq": ("exp_avg_sq",)}


def _boxes(shape: tuple[int, ...], s: int, e: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of rectangles of a tensor of `shape` covering its flat elements [s, e) in order, each one
    contiguous in memory."""
    if s >= e:
        return []
    if len(shape) <= 1:
        return [((s,), (e - s,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    out: list = []
    r0, r1 = s // row, e // row
    if s % row:  # a partial first row
        stop = min(e, (r0 + 1) * row)
        out += [((r0, *o), (1, *z)) for o, z in _boxes(shape[1:], s - r0 * row, stop - r0 * row)]
        if stop == e:
            return out
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if e % row:  # a partial last row
        out += [((r1, *o), (1, *z)) for o, z in _boxes(shape[1:], 0, e - r1 * row)]
    return out


def view_chunks(view: StateView, rows: int | None = None) -> list[tuple[tuple, tuple, torch.Tensor]]:
    """(global offsets, sizes, a view of those elements in `view.tensor`) of every rectangle the view holds;
    `rows`: only global rows below it (the real vocabulary of a padded tensor)."""
    spec, local = view.spec, view.spec.local_shape
    pieces = spec.ranges() if spec.dim is not None else None
    piece = (local[spec.dim] // spec.sections) if spec.dim is not None else 0
    out, pos = [], 0
    for offsets, sizes in _boxes(local, view.start, view.stop):
        n = math.prod(sizes)
        box = view.tensor[pos:pos + n].view(sizes)
        pos += n
        parts = [(offsets, box)]
        if pieces is not None and sizes:  # split where the tp shard's sections jump, along its dim
            d, parts = spec.dim, []
            x, end = offsets[spec.dim], offsets[spec.dim] + sizes[spec.dim]
            while x < end:
                k = x // piece
                stop = min(end, (k + 1) * piece)
                glob = (*offsets[:d], pieces[k][0] + x - k * piece, *offsets[d + 1:])
                parts.append((glob, box.narrow(d, x - offsets[d], stop - x)))
                x = stop
        for glob, tensor in parts:
            if rows is not None and glob and glob[0] + tensor.shape[0] > rows:
                tensor = tensor[: max(0, rows - glob[0])]
            if tensor.numel():
                out.append((tuple(glob), tuple(tensor.shape), tensor))
    return out


def _global_size(view: StateView, rows: int | None) -> tuple[int, ...]:
    shape = view.spec.global_shape
    return (rows, *shape[1:]) if rows is not None else tuple(shape)


def save_views_dcp(folder: str | Path, views: list[StateView], clip_rows: dict[str, int]) -> None:
    """Collective: every rank writes the views it owns (`write`) into the DCP folder; `clip_rows`: global name ->
    rows stored (the vocabulary's). DCP checks on the coordinator that the chunks tile every tensor exactly."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    items, data = [], {}
    for view in (v for v in views if v.write):
        key, rows = f"{view.kind}/{view.name}", clip_rows.get(view.name)
        for offsets, sizes, tensor in view_chunks(view, rows):
            index = MetadataIndex(key, torch.Size(offsets))
            data[(key, tuple(offsets))] = tensor
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=TensorProperties(dtype=tensor.dtype), size=torch.Size(_global_size(view, rows)))))

    class Planner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
            return data[(write_item.index.fqn, tuple(write_item.index.offset))].detach().contiguous()

    save({}, storage_writer=FileSystemWriter(str(folder)), planner=Planner(flatten_state_dict=False))


def load_views_dcp(folder: str | Path, views: list[StateView], clip_rows: dict[str, int], *,
                   kinds: tuple[str, ...] | None = None) -> None:
    """Collective: fill every view (of the given kinds) from the DCP folder, resharded by DCP's planner; a view
    whose tensor is absent or of another shape raises ValueError naming it."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    wanted = [v for v in views if kinds is None or v.kind in kinds]
    targets: dict[str, torch.Tensor] = {}

    class Planner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            self.metadata = metadata

        def create_local_plan(self) -> LoadPlan:
            saved = self.metadata.state_dict_metadata
            items: list[ReadItem] = []
            for view in wanted:
                sources = ("master", "param") if view.kind == "param" and view.tensor.dtype in (
                    torch.float32, torch.float64) else SOURCES[view.kind]
                key = next((f"{k}/{view.name}" for k in sources if f"{k}/{view.name}" in saved), None)
                rows = clip_rows.get(view.name)
                if key is None:
                    raise ValueError(f"DCP checkpoint {folder} has no {view.kind} of {view.name} (looked for "
                                     f"{', '.join(f'{k}/{view.name}' for k in sources)})")
                if tuple(saved[key].size) != _global_size(view, rows):
                    raise ValueError(f"DCP checkpoint {folder}: {key} has shape {tuple(saved[key].size)}, this model "
                                     f"{_global_size(view, rows)}")
                if rows is not None:
                    view.tensor.zero_()  # the padded vocabulary's rows are not stored: inert zeros
                for offsets, sizes, tensor in view_chunks(view, rows):
                    dest = f"{len(targets)}"
                    targets[dest] = tensor
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                    items += [dataclasses.replace(item, dest_index=MetadataIndex(dest, item.dest_index.offset))
                              for item in create_read_items_for_chunk_list(key, saved[key], [chunk])]
            return LoadPlan(items)

        def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
            tensor = targets[read_item.dest_index.fqn]
            for d, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                tensor = tensor.narrow(d, offset, length)
            return tensor

        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            pass  # resolve_tensor's narrow view already wrote into the live storage

    with torch.no_grad():
        load({}, storage_reader=FileSystemReader(str(folder)), planner=Planner(flatten_state_dict=False))


def save_dcp_checkpoint(root: str | Path, step: int, views: list[StateView], *, extras: dict, common: dict,
                        layout: dict, keep: int, clip_rows: dict[str, int], verify: bool = True) -> Path:
    """Collective: the views as a DCP checkpoint published like every other (io.py: written into .tmp-step_N,
    every file's size and sha256 in manifest.json with "storage": "dcp", renamed, `latest`, keep-K), so
    resume, `latest_good_checkpoint` and corruption detection treat both formats alike. Each rank's extras (its
    random streams) go in its rank file beside the DCP files, as in the native format."""
    from megazoo.data.fileio import file_sha256
    from megazoo.parallel.checkpoint.io import _publish, _world, _write_rank, finish_save, prepare_save_dir

    rank, _ = _world()
    tmp = prepare_save_dir(root, step)
    error = None
    try:
        save_views_dcp(tmp, views, clip_rows)  # torch's DCP: raises on every rank when one fails
    except Exception as err:  # noqa: BLE001 - gathered like any rank's write error
        error = f"rank {rank}: torch.distributed.checkpoint save failed: {type(err).__name__}: {err}"
    status = _write_rank(tmp, rank, ({}, []), extras, common if rank == 0 else None, verify)
    if error is None:  # this rank's DCP files (FileSystemWriter names them __<rank>_<n>.distcp; rank 0: .metadata)
        own = sorted(tmp.glob(f"__{rank}_*.distcp")) + ([tmp / ".metadata"] if rank == 0 else [])
        status["files"].update({f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in own})
    status["error"] = status["error"] or error
    return finish_save(root, tmp, step, status,
                       lambda gathered: _publish(Path(root), tmp, step, gathered, layout, keep, storage="dcp"))


def vocab_rows(views: list[StateView], vocab_size: int) -> dict[str, int]:
    """The rows a DCP checkpoint stores of each padded vocabulary tensor: the model's real vocabulary."""
    return {v.name: vocab_size for v in views if v.name.endswith(("wte.weight", "lm_head.weight"))}
