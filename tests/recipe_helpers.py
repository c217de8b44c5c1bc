"""Small recipes for tests: a tiny GPT on synthetic tokens, dropout off so every layout is comparable.

Parity recipes run in fp64: reduction-order differences between layouts are then ~1e-15, so the tests can hold
every layout to tolerances a million times tighter than any real bug (fp32 rounding, amplified by Adam on
near-zero gradients, would need ~1e-4 on parameters).
"""

from __future__ import annotations

import copy

from megazoo.recipes.config import Recipe, from_dict
from megazoo.recipes.resolve import Resolved, resolve

TINY = {
    "model": {"preset": "gpt2-tiny", "n_layer": 2, "vocab_size": 300, "dropout": 0.0, "attn_dropout": 0.0},
    "parallel": {"dp": 1, "tp": 1, "pp": 1},
    "train": {"steps": 10, "micro_batch": 4, "grad_accum": 1, "seq_len": 32, "lr": 3e-3, "min_lr": 3e-4,
              "warmup_steps": 3, "grad_clip": 0.5, "seed": 7, "eval_batches": 2, "precision": "fp64"},
    "data": {"source": "synthetic", "synthetic_tokens": 20_000},
    "logging": {"progress": False},
    "checkpoint": {"at_end": False},  # tests that save say so (and where)
    # The elementwise reference AdamW: torch's fused CPU kernel rounds an element differently depending on its
    # SIMD lane, i.e. on its offset in a ZeRO flat buffer, and Adam amplifies that 1-ulp noise on near-zero
    # gradients. Kernel equivalence (fused == reference) is tested in tests/test_kernels*.py.
    "kernels": {"adamw": "reference"},
}


def tiny_recipe(**sections: dict) -> Recipe:
    """TINY with some keys replaced, e.g. tiny_recipe(parallel={"tp": 2}, train={"micro_batch": 2})."""
    table = copy.deepcopy(TINY)
    for section, values in sections.items():
        table.setdefault(section, {}).update(values)
    return from_dict(Recipe, table)


def tiny_resolved(**sections: dict) -> Resolved:
    return resolve(tiny_recipe(**sections))
