"""Host memory one rank needs while `model.from_hf` loads it (models/hf/converter.py: fill_views_from_hf).

A rank reads its parameters one view at a time: for each it copies out of the safetensors files only the rows (and,
for a row-parallel weight, the columns) its tp shard holds, concatenates them, and copies them into its views (a
second copy in the view's dtype when it differs from the file's: the fp32 master of a bf16 file). The mappings of
the files are opened per read and closed after it, so nothing else grows. The peak is set by the largest single
read R (bytes in the file's dtype, the quantity the reader counts) and its E elements:

    peak = R + max(R, E x b)      (the blocks and their concatenation; or the rows and their copy in b bytes)

where b is the widest view dtype (4 with fp32 masters). R for a parameter is its tp-local tensor (the real
vocabulary's rows only: padded rows are zeros, not read); under ZeRO-3 a rank's view is a range of that tensor, so
R is an upper bound there; a key-map entry that joins whole HF tensors (stacked MoE experts, torchtitan's q / k
order) reads them whole. The test holds this R equal to the largest read the reader counts
(tests/recipes/planner/test_hf_load_plan.py). The rank's model states (parameters, masters, moments on the host
or the GPU) are the memory plan's, not counted here.

Measured (benchmarks/convert_memory.py, README "Giant checkpoints in and out"): with glibc told not to keep freed
blocks (MALLOC_MMAP_THRESHOLD_=131072) a rank's peak is this figure; with glibc's default, which raises its mmap
threshold after large frees and keeps later freed blocks for reuse, the peak was up to ~1.7 x it (blocks of the
earlier, smaller reads still held when the largest one runs). The line says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megazoo.models.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}


@dataclass(frozen=True)
class LoadMemory:
    largest_read: int  # R: bytes of the largest single read (file dtype)
    name: str  # the parameter it reads
    elements: int  # E: elements it fills
    file_bytes: int  # bytes per element in the HF files
    view_bytes: int  # b: widest view dtype's bytes

    @property
    def peak(self) -> int:
        return self.largest_read + max(self.largest_read, self.elements * self.view_bytes)

    def line(self, tp: int, zero3: bool = False) -> str:
        bound = " at most" if zero3 else ""  # ZeRO-3 views are pieces of the tp-local tensors
        return (f"  loading model.from_hf: host memory per rank{bound} {self.peak / 1e9:.2f} GB above the process "
                f"(largest single read {self.largest_read / 1e9:.2f} GB: {self.name} at tp {tp}, "
                f"{self.file_bytes}-byte weights; peak = R + max(R, E x {self.view_bytes}), plus what glibc keeps "
                "of earlier reads unless MALLOC_MMAP_THRESHOLD_ is set: recipes/planner/hf_load.py)")


def file_dtype_bytes(folder: str) -> int:
    """Bytes per weight of an HF folder, from its config.json's dtype; 2 (bf16, how Llama-class models ship)
    when the folder or the field is absent (planning before the download)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return 2
    return DTYPE_BYTES.get(str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"), 2)


def load_memory(cfg: ModelConfig, tp: int, file_bytes: int, view_bytes: int) -> LoadMemory:
    """The largest single read of any rank of a tp-`tp` layout (the peak rank's), and the peak it implies."""
    from megazoo.models.hf.families import family_of_config  # the key map: which entries join whole tensors
    from megazoo.models.layout import VOCAB_PARAMETERS, parameter_layout

    entries = {e.ours: e for e in family_of_config(cfg).entries(cfg)}
    best = (0, "", 0)
    for p in parameter_layout(cfg, tp):
        entry, local = entries.get(p.name), p.local_shape(tp)
        elements = math.prod(local)
        if entry is not None and (entry.join_fn is not None or entry.split_fn is not None):
            read = sum(math.prod(s) for s in entry.hf_shapes) * file_bytes
        elif p.name in VOCAB_PARAMETERS:  # tp rank 0 holds the most real rows
            read = min(local[0], cfg.vocab_size) * math.prod(local[1:]) * file_bytes
        else:
            read = elements * file_bytes
        best = max(best, (read, p.name, elements))
    return LoadMemory(best[0], best[1], best[2], file_bytes, view_bytes)


def describe(resolved, from_hf: str) -> str | None:
    """`megazoo plan --recipe`'s line for a recipe with model.from_hf = `from_hf` (None without it). The folder need
    not be at hand (resolve_for_planning's preset stands in; its dtype is then taken as bf16)."""
    if not from_hf:
        return None
    recipe = resolved.recipe
    view = 8 if recipe.train.precision == "fp64" else 4  # fp32 masters under bf16 / fp16, fp32 or fp64 params
    plan = load_memory(resolved.model, recipe.parallel.tp, file_dtype_bytes(from_hf), view)
    return plan.line(recipe.parallel.tp, zero3=recipe.zero.stage == 3)
