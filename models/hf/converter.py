"""The one converter: HF folder <-> megazoo checkpoint, tensor by tensor, for every family (models/hf/families.py).

Neither direction holds the model: HF -> megazoo reads each megazoo tensor's HF tensors (safetensors_files.py:
HFWeights), joins them by the family's key map and hands the result to the streaming checkpoint writer
(parallel/checkpoint/consolidate.py: write_streamed_checkpoint); megazoo -> HF assembles one full tensor at a
time from the checkpoint's rank files (CheckpointReader, any layout: no rank consolidates the model), splits it
by the key map and streams the pieces into safetensors files laid out beforehand (write_shards). Peak resident
memory is a small multiple of the largest tensor (tests/models/hf/test_streaming_memory.py measures it).

Everything the key map implies is checked against the files' headers before a tensor is read: missing or extra
tensors, wrong shapes, a model_type no family converts, a dtype safetensors cannot hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.hf.family import Family, exported_config
from megazoo.models.hf.safetensors_files import DEFAULT_MAX_SHARD, HFWeights, write_shards
from megazoo.parallel.tensor import ShardSpec, shard_of

DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(text: str | None) -> torch.dtype | None:
    """--dtype: None / "auto" keeps the checkpoint's; else fp32, bf16 or fp16."""
    if text in (None, "auto"):
        return None
    if text not in DTYPE_NAMES:
        raise ValueError(f"--dtype {text!r} is not one HF files store here; valid: auto, fp32, bf16, fp16")
    return DTYPE_NAMES[text]


# Stored dtypes a conversion reads (safetensors' names; torch's in a pytorch_model.bin or a DCP folder).
_CONVERTIBLE = {"F64", "F32", "BF16", "F16", "torch.float64", "torch.float32", "torch.bfloat16", "torch.float16"}


def check_hf_names(weights: HFWeights, family: Family, cfg: ModelConfig) -> None:
    """Every tensor the key map needs is in the files at its shape, and nothing else is (headers only)."""
    entries = family.entries(cfg)
    wanted = {name: shape for e in entries for name, shape in zip(e.hf, e.hf_shapes)}
    present = set(weights.names())
    missing = sorted(set(wanted) - present)
    if missing:
        raise ValueError(f"HF checkpoint {weights.dir} lacks {len(missing)} tensor(s) of model {cfg.name}, e.g. "
                         f"{missing[:8]}")
    wrong = [f"{n}: {weights.shape(n)} != {s}" for n, s in wanted.items() if weights.shape(n) != tuple(s)]
    if wrong:
        raise ValueError(f"HF checkpoint {weights.dir}: tensor shapes do not match model {cfg.name}: {wrong[:8]}")
    odd = [f"{n}: {weights.dtype(n)}" for n in wanted if weights.dtype(n) not in _CONVERTIBLE]
    if odd:
        raise ValueError(f"HF checkpoint {weights.dir} stores {len(odd)} tensor(s) in a dtype megazoo cannot convert, "
                         f"e.g. {odd[:4]}; valid: F64, F32, BF16, F16 (a quantized model: dequantize it first)")
    tied = family.tied_head(cfg)
    extra = sorted(n for n in present - set(wanted) - ({tied[0]} if tied else set())
                   if not n.endswith(family.ignored))
    if extra:
        raise ValueError(f"HF checkpoint {weights.dir} has {len(extra)} tensor(s) model {cfg.name} does not hold, "
                         f"e.g. {extra[:8]}")


def check_copies(weights: HFWeights, family: Family, cfg: ModelConfig) -> None:
    """Copies the key map reads once (a tied head stored anyway, the MTP layers' shared embedding and head) equal
    the tensors they copy: read only where the folder holds such a copy."""
    tied = family.tied_head(cfg)
    if tied and tied[0] in weights.names() and not torch.equal(weights.read(tied[0]), weights.read(tied[1])):
        raise ValueError(f"{tied[0]} differs from {tied[1]} but model {cfg.name} ties its output head to the "
                         "embedding: it cannot hold this checkpoint")
    if family.mtp and cfg.mtp_depth:  # the MTP layers' copies of the shared embedding and head: equal to them
        from megazoo.models.deepseek.mtp_hf import check_shared_copies

        main = {e.ours: e.hf[0] for e in family.entries(cfg) if e.ours in ("wte.weight", "lm_head.weight")}
        check_shared_copies(weights.read, cfg, main["wte.weight"], main.get("lm_head.weight", main["wte.weight"]),
                            present=set(weights.names()))


def megazoo_tensors(weights: HFWeights, family: Family, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, full tensor) of every parameter, read from the HF files one entry at a time."""
    check_hf_names(weights, family, cfg)
    check_copies(weights, family, cfg)
    for entry in family.entries(cfg):
        yield entry.ours, entry.join([weights.read(name) for name in entry.hf])


def hf_plan(family: Family, cfg: ModelConfig, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, shape, dtype) of every tensor an export writes, in writing order (a tied head left out)."""
    return [(name, tuple(shape), dtype) for e in family.written_entries(cfg) for name, shape in zip(e.hf, e.hf_shapes)]


def hf_tensors(read, family: Family, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) in hf_plan's order; `read(our name)` gives one full megazoo tensor."""
    for entry in family.written_entries(cfg):
        yield from zip(entry.hf, entry.split(read(entry.ours)))


def write_hf_folder(out_dir: str | Path, family: Family, cfg: ModelConfig, read, dtype: torch.dtype, *, tokenizer=None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD, generation: dict | None = None) -> list[str]:
    """An HF folder transformers loads: config.json (with its dtype), generation_config.json, the weights in
    `dtype` as sharded safetensors, and `tokenizer` (a megazoo Tokenizer) as an HF tokenizer. `read(our name)`
    gives one full tensor at a time; `generation`: extra generation_config.json fields (an SFT export's stops)."""
    from transformers import GenerationConfig

    from megazoo.models.hf.tokenizer_export import save_hf_tokenizer, special_ids

    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but model {cfg.name} only {cfg.vocab_size}")
    cfg = exported_config(family, cfg)  # MTP modules the format has no place for: left out (family.py)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special = special_ids(tokenizer) if tokenizer is not None else None
    config = family.config_to_hf(cfg, special)
    config.dtype = dtype  # recorded as "dtype" in config.json (transformers 5; "torch_dtype" in 4.x)
    config.torch_dtype = dtype
    files = write_shards(out_dir, hf_plan(family, cfg, dtype), hf_tensors(read, family, cfg), max_shard_bytes)
    config.save_pretrained(str(out_dir))
    generation_config = GenerationConfig.from_model_config(config)
    for key, value in (generation or {}).items():
        setattr(generation_config, key, value)
    generation_config.save_pretrained(str(out_dir))
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, out_dir, max_length=cfg.n_positions)
    return files


class LazyState(Mapping):
    """A full state read name by name (load_full_state_into indexes it once per parameter): no whole copy.
    `dtype`: values rounded to it first (what an export in that dtype holds)."""

    def __init__(self, read, names, dtype: torch.dtype | None = None):
        self._read, self._names, self._dtype = read, list(names), dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        tensor = self._read(name)
        return tensor.to(self._dtype) if self._dtype is not None else tensor

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)



# --- a rank's own slices straight from the HF files (`model.from_hf`): no conversion, no whole tensor -------------

def _local_rows(spec: ShardSpec, lo: int, hi: int) -> list[tuple[int, int]]:
    """Global row ranges of the tp-local tensor's rows [lo, hi) (a column-parallel shard holds a block of rows
    per section; other layouts hold every row)."""
    ranges = spec.ranges() if spec.dim == 0 else [(0, spec.global_shape[0])]
    out, offset = [], 0
    for a, b in ranges:
        s, e = max(lo, offset), min(hi, offset + b - a)
        if s < e:
            out.append((a + s - offset, a + e - offset))
        offset += b - a
    return out


def _global_block(weights: HFWeights, entry, a: int, b: int, cols: list[tuple[int, int]] | None,
                  spec: ShardSpec) -> torch.Tensor:
    """Rows [a, b) of our global tensor (only the column ranges `cols` of a row-parallel shard), read from the HF
    tensors that make them; rows past the HF tensors (the padded vocabulary) are zeros."""
    if entry.transpose:  # GPT-2's Conv1D: our rows are HF columns, our columns HF rows
        hf_rows = cols or [(0, entry.hf_shapes[0][0])]
        return torch.cat([weights.read_block(entry.hf[0], r, (a, b)) for r in hf_rows]).t()
    out, offset = [], 0
    for name, shape in zip(entry.hf, entry.hf_shapes):
        s, e = max(a, offset), min(b, offset + shape[0])
        if s < e:
            rows = (s - offset, e - offset)
            out.append(weights.read_block(name, rows) if cols is None else
                       torch.cat([weights.read_block(name, rows, c) for c in cols], dim=1))
        offset += shape[0]
    if b > offset:
        width = (sum(c1 - c0 for c0, c1 in cols),) if cols else tuple(spec.global_shape[1:])
        out.append(torch.zeros((b - max(a, offset), *width), dtype=out[0].dtype if out else torch.float32))
    return torch.cat(out)


def read_local(weights: HFWeights, entry, spec: ShardSpec, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the tp-local tensor `spec` cuts from our parameter `entry.ours` (1-D), reading
    only the rows that hold them (at most one partial row either side: a ZeRO-3 range)."""
    local = spec.local_shape
    row = math.prod(local[1:])
    lo, hi = start // row, -(-stop // row)
    if entry.stacked and spec.dim in (None, 0):  # stacked experts: only the experts of rows [lo, hi) (ep's own)
        k = entry.stacked
        rows = torch.cat([entry.join([weights.read(n) for n in entry.hf[a * k:b * k]])
                          for a, b in _local_rows(spec, lo, hi)])
    elif entry.join_fn is not None or entry.split_fn is not None or entry.stacked:  # the whole tensor, then cut
        full = entry.join([weights.read(n) for n in entry.hf])
        if full.shape[0] < spec.global_shape[0]:
            full = torch.cat([full, full.new_zeros(spec.global_shape[0] - full.shape[0], *full.shape[1:])])
        rows = shard_of(full, spec)[lo:hi]
    else:
        cols = spec.ranges() if spec.dim == 1 else None
        rows = torch.cat([_global_block(weights, entry, a, b, cols, spec) for a, b in _local_rows(spec, lo, hi)])
    return rows.reshape(-1)[start - lo * row: stop - lo * row]


def fill_views_from_hf(weights: HFWeights, family: Family, cfg: ModelConfig, views, kinds=("param", "master")):
    """Fill this rank's state views (parallel/checkpoint/views.py) of the given kinds straight from the HF files:
    each view reads only its own elements. Returns how many views were filled; `weights.largest_read`: the bytes of
    the largest single read (what recipes/planner/hf_load.py plans the host memory from)."""
    by_name = {e.ours: e for e in family.entries(cfg)}
    check_hf_names(weights, family, cfg)
    last: tuple | None = None
    filled = 0
    for view in sorted((v for v in views if v.kind in kinds), key=lambda v: (v.name, v.start)):
        if view.name not in by_name:
            raise ValueError(f"{weights.dir}: model {cfg.name} has parameter {view.name}, which the "
                             f"{family.name} key map does not name")
        key = (view.name, view.spec, view.start, view.stop)
        if last is None or last[0] != key:  # a master and its parameter share one read
            before = weights.bytes_read
            last = (key, read_local(weights, by_name[view.name], view.spec, view.start, view.stop))
            weights.largest_read = max(getattr(weights, "largest_read", 0), weights.bytes_read - before)
        view.tensor.copy_(last[1].to(view.tensor.dtype))
        filled += 1
    return filled

