"""torch.distributed.checkpoint (DCP) folders, through torch's own DCP (FileSystemReader / FileSystemWriter): read
one tensor at a time (a state dict of one key, loaded from the folder's metadata), written from a state dict.

Used by `megazoo convert dcp-to-megazoo` / `megazoo-to-dcp` (models/hf/convert_cli.py), so a torchtitan checkpoint
(whose model keys may sit at the top level or under "model.") becomes a megazoo checkpoint and back. Without a
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
        metadata = FileSystemReader(str(self.dir)).read_metadata().state_dict_metadata
        self._meta = {k: v for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
        model_keys = [k for k in self._meta if k.startswith("model.")]
        self._prefix = "model." if model_keys and len(model_keys) == len(self._meta) else ""  # {"model": {...}}
        self.bytes_read = 0

    def names(self) -> list[str]:
        return [k.removeprefix(self._prefix) for k in self._meta]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[self._prefix + name].size)

    def dtypes(self) -> set[str]:
        return {str(m.properties.dtype).removeprefix("torch.") for m in self._meta.values()}

    def read(self, name: str) -> torch.Tensor:
        from torch.distributed.checkpoint import FileSystemReader, load

        meta = self._meta[self._prefix + name]
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        load({self._prefix + name: tensor}, storage_reader=FileSystemReader(str(self.dir)))
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def save_dcp(state: dict[str, torch.Tensor], out: str | Path) -> None:
    """Write `state` as a DCP folder (one process: DCP's no-dist mode)."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    save(state, storage_writer=FileSystemWriter(str(out)))
