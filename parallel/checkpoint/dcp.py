"""torch.distributed.checkpoint (DCP) folders, through torch's own DCP (FileSystemReader / FileSystemWriter): read
one tensor at a time (a state dict of one key, loaded from the folder's metadata), written from a state dict.

Used by `megazoo convert dcp-to-megazoo` / `megazoo-to-dcp` (models/hf/convert_dcp.py), so a torchtitan checkpoint
(whose model keys may sit at the top level or under "model.") becomes a megazoo checkpoint and back; both stream
(one tensor held at a time). Without a
process group DCP runs as one rank (torch's no-dist mode).
"""

from __future__ import annotations

from pathlib import Path

import torch


class DCPReader:
    """A DCP folder's tensors by name (the duck type of models/hf/safetensors_files.HFWeights the converter reads)."""

    def __init__(self, path: str | Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.dir = Path(path)
        if not (self.dir / ".metadata").is_file():
            raise FileNotFoundError(f"{self.dir} is not a torch.distributed.checkpoint folder (no .metadata)")
        try:
            whole = FileSystemReader(str(self.dir)).read_metadata()
        except Exception as error:  # torch raises pickle / EOF errors for a truncated or foreign .metadata
            raise ValueError(f"{self.dir}/.metadata is not a readable DCP metadata file: {error!r}") from error
        _check_storage(self.dir, whole.storage_data or {})
        metadata = whole.state_dict_metadata
        self._meta = {k: v for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
        model_keys = [k for k in self._meta if k.startswith("model.")]
        self._prefix = "model." if model_keys and len(model_keys) == len(self._meta) else ""  # {"model": {...}}
        self.bytes_read = 0
        self._last: tuple[str, torch.Tensor] | None = None

    def names(self) -> list[str]:
        return [k.removeprefix(self._prefix) for k in self._meta]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[self._prefix + name].size)

    def dtype(self, name: str) -> str:
        return str(self._meta[self._prefix + name].properties.dtype)

    def dtypes(self) -> set[str]:
        return {str(m.properties.dtype).removeprefix("torch.") for m in self._meta.values()}

    def read_block(self, name: str, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows [rows) (and columns [cols)) of a tensor: the HFWeights interface a rank's slices are read through
        (models/hf/converter.py: read_local). The last tensor read is kept, so a rank's several views of one
        parameter (and its master) read it once; DCP reads whole saved chunks anyway."""
        if self._last is None or self._last[0] != name:
            self._last = (name, self.read(name))
        block = self._last[1][rows[0]:rows[1]]
        return (block if cols is None else block[:, cols[0]:cols[1]]).clone()

    def read(self, name: str) -> torch.Tensor:
        from torch.distributed.checkpoint import FileSystemReader, load

        meta = self._meta[self._prefix + name]
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        load({self._prefix + name: tensor}, storage_reader=FileSystemReader(str(self.dir)), no_dist=True)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _check_storage(folder: Path, storage: dict) -> None:
    """Every data file the metadata names is there and long enough for the bytes it places in it, so a folder
    missing a rank's file (an interrupted copy) is refused before anything is read or written."""
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in needed if not (folder / name).is_file())
    if missing:
        raise FileNotFoundError(f"DCP folder {folder}: its .metadata names {len(missing)} data file(s) that are not "
                                f"there: {', '.join(missing[:4])} (an incomplete copy?)")
    short = sorted(f"{name} ({(folder / name).stat().st_size} < {size} bytes)" for name, size in needed.items()
                   if (folder / name).stat().st_size < size)
    if short:
        raise ValueError(f"DCP folder {folder}: data file(s) shorter than its .metadata says: {', '.join(short[:4])} "
                         "(truncated?)")


def save_dcp_streamed(plan: list[tuple[str, tuple[int, ...], torch.dtype]], get, out: str | Path) -> None:
    """Write the tensors of `plan` (name, shape, dtype) as a DCP folder, one process, one tensor at a time:
    `get(name)` is called when DCP's writer reaches that tensor. Each tensor goes in its own data file
    (FileSystemWriter(single_file_per_rank=False)), because DCP's file writer keeps every tensor of a file until
    the file is finished: one file per tensor is what keeps the peak at one tensor."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    planned = {name: (tuple(shape), dtype) for name, shape, dtype in plan}
    items = [WriteItem(index=MetadataIndex(name, torch.Size([0] * len(shape))), type=WriteItemType.TENSOR,
                       tensor_data=TensorWriteData(
                           chunk=ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape)),
                           properties=TensorProperties(dtype=dtype), size=torch.Size(shape)))
             for name, shape, dtype in plan]

    class Planner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
            name = write_item.index.fqn
            tensor = get(name)
            if tuple(tensor.shape) != planned[name][0]:
                raise RuntimeError(f"{name}: got shape {tuple(tensor.shape)} where {planned[name][0]} was planned")
            return tensor.detach().to("cpu", planned[name][1]).contiguous()

    save({}, storage_writer=FileSystemWriter(str(out), single_file_per_rank=False),
         planner=Planner(flatten_state_dict=False), no_dist=True)
