"""An HF folder's weights read and written one tensor at a time (safetensors files, sharded as transformers does).

Reading (`HFWeights`): names, shapes and dtypes come from the files' headers (safetensors' `safe_open`, which
maps the file and reads nothing else); `read(name)` copies one tensor out and `read_block(name, rows, cols)` a
block of it (`get_slice`), each through a handle opened for that read and closed after it, so the pages the read
touched leave the process with the mapping: resident memory grows by the tensor read, never by the file.
`bytes_read` counts the tensor bytes copied out (what a rank loading its own slices reads).
A model.safetensors.index.json that names a missing file, or a folder without weights, is refused before any
tensor is read. A legacy pytorch_model.bin is read through torch.load(mmap=True, weights_only=True).

Writing (`write_shards`): the header of a safetensors file lists every tensor's dtype, shape and byte range, all
known from the key map before any data is read, so each file is laid out first and then filled tensor by tensor
as the converter produces them (safetensors' own save_file needs every tensor in memory at once). Files are cut
at `max_shard_bytes` in the order tensors arrive (a tensor larger than that gets a file of its own), named as
transformers names them (model.safetensors when one file suffices, else model-0000k-of-0000n.safetensors plus
model.safetensors.index.json with the total size and every tensor's file).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

SINGLE, INDEX, PICKLE = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DEFAULT_MAX_SHARD = 5 * 10**9  # transformers' save_pretrained default, "5GB"
_NUMBERED = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def storable(dtype: torch.dtype, what: str = "--dtype") -> torch.dtype:
    """`dtype` when safetensors files written here hold it; else a ValueError naming the valid ones."""
    if dtype not in DTYPES:
        raise ValueError(f"{what} {str(dtype).removeprefix('torch.')} cannot be written to HF safetensors files "
                         f"here; valid: {', '.join(str(d).removeprefix('torch.') for d in DTYPES)}")
    return dtype


def missing_numbered(names) -> list[str]:
    """Files model-0000k-of-0000n.safetensors that the numbering of `names` implies but `names` lacks."""
    present = {_NUMBERED.fullmatch(Path(n).name).groups() for n in names if _NUMBERED.fullmatch(Path(n).name)}
    totals = {total for _, total in present}
    return [f"model-{k:05d}-of-{total}.safetensors" for total in sorted(totals)
            for k in range(1, int(total) + 1) if (f"{k:05d}", total) not in present]


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (transformers' convention: GB = 10^9, GiB = 2^30)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    raw = text.strip().upper()
    for unit, factor in units.items():
        if raw.endswith(unit) and raw[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(raw[: -len(unit)]) * factor)
    if raw.isdigit():
        return int(raw)
    raise ValueError(f"--max-shard-size {text!r} is not a size; valid: bytes or a number with KB, MB, GB (10^3n) "
                     "or KiB, MiB, GiB (2^10n), e.g. 5GB")


class HFWeights:
    """The weights of an HF folder, read lazily (module docstring)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        self.bytes_read = 0
        self._pickle: dict | None = None
        self.files: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        single, index, pickle = self.dir / SINGLE, self.dir / INDEX, self.dir / PICKLE
        if single.is_file():
            shards = [single]
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise ValueError(f"HF index {index} is not a safetensors index (weight_map): {error!r}") from None
            shards = [self.dir / f for f in files]
            missing = [str(f) for f in shards if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"HF index {index} names {len(missing)} file(s) that are not there: "
                                        f"{', '.join(missing[:4])} (an incomplete download?)")
            gaps = missing_numbered(files)
            if gaps:
                raise FileNotFoundError(f"HF index {index} names {len(files)} shard(s) but their numbering implies "
                                        f"{', '.join(gaps[:4])} too (a truncated index?)")
        elif pickle.is_file():
            shards = []
            self._pickle = self._load_pickle(pickle)
            for name, t in self._pickle.items():
                self.files[name], self._meta[name] = pickle, (tuple(t.shape), str(t.dtype))
        else:
            numbered = sorted(p.name for p in self.dir.glob("model-*-of-*.safetensors"))
            if numbered:
                gaps = missing_numbered(numbered)
                raise FileNotFoundError(f"HF checkpoint directory {self.dir} holds {len(numbered)} sharded "
                                        f"safetensors file(s) but no {INDEX}" + (f", and lacks {', '.join(gaps[:4])}"
                                        if gaps else "") + " (an incomplete download? transformers needs the "
                                        "index and every shard it names)")
            raise FileNotFoundError(f"HF checkpoint directory {self.dir} has no {SINGLE}, {INDEX} or {PICKLE}")
        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for name in f.keys():
                        piece = f.get_slice(name)
                        self.files[name] = shard
                        self._meta[name] = (tuple(piece.get_shape()), piece.get_dtype())
            except Exception as error:  # safetensors raises its own error types for truncated / corrupt files
                raise ValueError(f"cannot read the weights of HF checkpoint {self.dir}: {shard.name}: {error}") \
                    from error
        if index.is_file() and not single.is_file():  # every tensor the index places is in that file
            wrong = [f"{n} -> {f}" for n, f in weight_map.items() if self.files.get(n, self.dir / f).name != f
                     or n not in self._meta]
            if wrong:
                raise ValueError(f"HF index {index} places {len(wrong)} tensor(s) in files that do not hold them, "
                                 f"e.g. {wrong[:4]} (index and shards from different downloads?)")

    @staticmethod
    def _load_pickle(path: Path) -> dict:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as error:  # torch raises several types for truncated or corrupt files
            raise ValueError(f"cannot read the weights of HF checkpoint {path}: {error}") from error

    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def nbytes(self, name: str) -> int:
        shape, dtype = self._meta[name]
        width = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}
        return math.prod(shape) * width.get(dtype.upper(), getattr(torch, dtype.removeprefix("torch."),
                                                                    torch.float32).itemsize)

    def dtypes(self) -> set[str]:
        return {dtype for _, dtype in self._meta.values()}

    def dtype(self, name: str) -> str:
        """The stored dtype, as the file names it ("BF16"; "torch.bfloat16" in a pytorch_model.bin)."""
        return self._meta[name][1]

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read(self, name: str) -> torch.Tensor:
        """One tensor, copied out of its file."""
        if self._pickle is not None:
            return self._count(self._pickle[name].clone())
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return self._count(f.get_tensor(name))

    def read_block(self, name: str, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows [rows) (and columns [cols) of a 2-D tensor) of a tensor, only those bytes read."""
        (r0, r1), (c0, c1) = rows, cols or (None, None)
        if self._pickle is not None:
            full = self._pickle[name]
            return self._count((full[r0:r1] if cols is None else full[r0:r1, c0:c1]).clone())
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            piece = f.get_slice(name)
            return self._count(piece[r0:r1] if cols is None else piece[r0:r1, c0:c1])


def shard_files(plan: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> list[list[int]]:
    """Indices of `plan` (name, shape, dtype) per file, cut in order at `max_shard_bytes`."""
    files: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(plan):
        nbytes = math.prod(shape) * dtype.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    return files


def _header(plan, indices) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for i in indices:
        name, shape, dtype = plan[i]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    return data + b" " * (-len(data) % 8)  # the data starts 8-byte aligned, as safetensors writes it


def write_shards(out_dir: str | Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                 tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int = DEFAULT_MAX_SHARD) -> list[str]:
    """Write `tensors` (arriving in `plan`'s order, each cast to its planned dtype) as safetensors files under
    `out_dir`; returns the file names written."""
    for dtype in {d for _, _, d in plan}:
        storable(dtype, "dtype")
    out_dir = Path(out_dir)
    groups = shard_files(plan, max_shard_bytes)
    names = [SINGLE] if len(groups) == 1 else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
                                                 for k in range(len(groups))]
    stream = iter(tensors)
    weight_map = {}
    for file_name, indices in zip(names, groups):
        header = _header(plan, indices)
        with open(out_dir / file_name, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for i in indices:
                name, shape, dtype = plan[i]
                got, tensor = next(stream)
                if got != name or tuple(tensor.shape) != tuple(shape):
                    raise RuntimeError(f"converter produced {got} {tuple(tensor.shape)} where {name} {shape} was "
                                       "planned")
                f.write(tensor.detach().to("cpu", dtype).contiguous().view(torch.uint8).numpy().data)
                weight_map[name] = file_name
    if len(names) > 1:
        total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in plan)
        (out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")
    return names
