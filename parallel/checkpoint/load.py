"""Loading a sharded checkpoint into any layout: assemble each global tensor from its pieces, cut what the
rank needs.

For every view this rank holds, the pieces of that (parameter, kind) - from whatever ranks, tp layout and ZeRO
chunks saved them - are written into the tp-local tensors of the saving layout, those are stitched into the
global tensor (honouring the fused-QKV sections), and the loading rank's own tp shard and flat range are cut
out. One parameter's global tensors exist at a time, never the whole model. The vocabulary padding may differ
between layouts (128 x tp): rows are trimmed or zero-padded; padded rows are inert by construction.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch

from megazoo.parallel.checkpoint.io import MANIFEST, CheckpointError, load_tensor_file, verify_checkpoint
from megazoo.parallel.checkpoint.views import StateView
from megazoo.parallel.tensor import ShardSpec, shard_of

# Where a view of this kind may find its values, best first.
SOURCES = {"param": ("param",), "master": ("master", "param"), "exp_avg": ("exp_avg",),
           "exp_avg_sq": ("exp_avg_sq",)}


def _assemble(entries: list[dict], files: dict, name: str, where: Path | None = None) -> torch.Tensor:
    """The global tensor `name` from its pieces; a piece that does not fit is an error naming its file."""
    shape = tuple(entries[0]["global_shape"])
    dtype = getattr(torch, entries[0]["dtype"])
    size = entries[0]["tp_size"]
    dim = entries[0]["tp_dim"]
    sections = entries[0]["tp_sections"]
    specs = [ShardSpec(shape, dim, sections, r, size) for r in range(size)]
    locals_ = [torch.empty(math.prod(s.local_shape), dtype=dtype) for s in specs]
    filled = [0] * size
    for e in entries:
        file = e["file"] if where is None else where / e["file"]
        try:
            piece = files[e["file"]]["pieces"][e["key"]]
            target = locals_[e["tp_rank"]]
            if not isinstance(piece, torch.Tensor) or not 0 <= e["start"] <= e["stop"] <= target.numel() \
                    or piece.numel() != e["stop"] - e["start"]:
                raise ValueError(f"range [{e['start']}, {e['stop']}) of {target.numel()} elements")
            target[e["start"]:e["stop"]].copy_(piece.view(-1))
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"checkpoint file {file}: piece {e.get('key')!r} of {name} does not fit its "
                                  f"entry in {MANIFEST} ({err})") from None
        filled[e["tp_rank"]] += e["stop"] - e["start"]
    if filled != [t.numel() for t in locals_]:
        raise CheckpointError(f"checkpoint pieces of {name} do not cover the tensor ({filled} of "
                              f"{[t.numel() for t in locals_]} elements per tp rank)")
    if dim is None:
        return locals_[0].view(shape)
    full = torch.empty(shape, dtype=dtype)
    for spec, flat in zip(specs, locals_):
        local = flat.view(spec.local_shape)
        for (lo, hi), part in zip(spec.ranges(), local.chunk(sections, dim=dim)):
            full.narrow(dim, lo, hi - lo).copy_(part)
    return full


def _fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim or zero-pad dim 0 (padded vocabulary of another tp)."""
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows]
    pad = torch.zeros((rows - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad])


@torch.no_grad()
def load_views(path: str | Path, views: list[StateView], *, kinds: tuple[str, ...] | None = None,
               manifest: dict | None = None) -> dict:
    """Fill every view (of the given kinds) from the checkpoint at `path`; return the manifest. `manifest`:
    the one `verify_checkpoint(path)` returned already (the files are then not hashed again)."""
    path = Path(path)
    manifest = verify_checkpoint(path) if manifest is None else manifest
    by_key: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for entry in manifest["pieces"]:
        by_key[(entry["name"], entry["kind"])].append(entry)
    wanted = [v for v in views if kinds is None or v.kind in kinds]
    def sources_of(view: StateView) -> tuple[str, ...]:
        if view.kind == "param" and view.tensor.dtype in (torch.float32, torch.float64):
            return ("master", "param")  # full-precision parameters prefer the fp32 masters
        return SOURCES[view.kind]

    # the files of every piece a view may read (the masters' too: with kinds=("param",) they live on other ranks)
    needed_files = {e["file"] for v in wanted for k in sources_of(v) for e in by_key.get((v.name, k), [])}
    files = {f: load_tensor_file(path / f) for f in sorted(needed_files)}
    cache: dict[tuple[str, str], torch.Tensor] = {}
    for view in sorted(wanted, key=lambda v: v.name):
        sources = sources_of(view)
        source = next((k for k in sources if (view.name, k) in by_key), None)
        if source is None:
            raise CheckpointError(f"checkpoint {path} has no {view.kind} for {view.name}")
        if (view.name, source) not in cache:
            cache = {k: v for k, v in cache.items() if k[0] == view.name}  # one parameter at a time
            full = _assemble(by_key[(view.name, source)], files, view.name, path)
            if view.name.endswith(("wte.weight", "lm_head.weight")):  # the padded vocabulary depends on tp
                full = _fit_rows(full, view.spec.global_shape[0])
            cache[(view.name, source)] = full
        try:
            local = shard_of(cache[(view.name, source)], view.spec).view(-1)
        except ValueError as err:
            raise CheckpointError(f"checkpoint {path}: {view.name} does not fit this model: {err}") from None
        view.tensor.copy_(local[view.start:view.stop])
    return manifest
