"""`megazoo convert ... --verify`: an export counts once it scores the same.

A fixed sample of token ids (seeded, two sequences of up to 64 tokens) goes through the megazoo GPT built from the
full state and through the Hugging Face GPT2LMHeadModel loaded by transformers from the converted directory (or,
for hf-to-megazoo, through the HF source and the megazoo checkpoint just written), both in fp64 with eager
attention. Compared: the logits (largest absolute difference) and the mean next-token cross-entropy of the sample
(relative difference). In fp64 two correct implementations agree to ~1e-12; a conversion bug (a missed transpose,
permuted heads, a dropped bias) moves logits by orders of magnitude more than the tolerance below.
"""

from __future__ import annotations

import json

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megazoo.models.config import ModelConfig
from megazoo.models.hf.gpt2 import gpt_from_full_state
from megazoo.parallel.topology import Topology

if TYPE_CHECKING:
    from megazoo.models.hf.convert_slices import SliceComparison, SliceData

LOGITS_ATOL = 1e-10  # fp64: implementations agree to ~1e-14 on logits of order 1-10
LOSS_RTOL = 1e-10


@dataclass(frozen=True)
class ExportCheck:
    sample: tuple[int, int]  # (sequences, tokens)
    logits_max_abs: float
    loss_megazoo: float
    loss_hf: float
    slices: SliceComparison | None = None  # the WikiText / LAMBADA slices (convert_slices.py), when data was found

    @property
    def loss_rel(self) -> float:
        return abs(self.loss_megazoo - self.loss_hf) / max(abs(self.loss_hf), 1e-300)

    @property
    def passed(self) -> bool:
        sample_ok = self.logits_max_abs <= LOGITS_ATOL and self.loss_rel <= LOSS_RTOL
        return sample_ok and (self.slices is None or self.slices.passed)

    def table(self) -> str:
        rows = [("logits (max abs difference)", self.logits_max_abs, LOGITS_ATOL),
                ("sample loss (relative difference)", self.loss_rel, LOSS_RTOL)]
        lines = [f"verify: a fixed sample of {self.sample[0]} x {self.sample[1]} tokens through megazoo and "
                 f"through transformers, fp64 (loss: megazoo {self.loss_megazoo:.12g}, HF {self.loss_hf:.12g})",
                 f"  {'quantity':<36}{'deviation':>12}{'tolerance':>11}  result"]
        lines += [f"  {name:<36}{dev:>12.2e}{tol:>11.0e}  {'pass' if dev <= tol else 'FAIL'}" for name, dev, tol in rows]
        return "\n".join(lines + ([self.slices.table()] if self.slices is not None else []))


def fixed_sample(cfg: ModelConfig, sequences: int = 2, tokens: int = 64) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (sequences, min(tokens, cfg.n_positions)),
                         generator=torch.Generator().manual_seed(0))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


def megazoo_logits_fn(cfg: ModelConfig, full_state: dict[str, torch.Tensor]):
    model = gpt_from_full_state(cfg, full_state, Topology.solo(), dtype=torch.float64)
    return torch.no_grad()(lambda ids: model(ids)[..., : cfg.vocab_size])  # drop the padded vocabulary's columns


def hf_dir_logits_fn(hf_dir: str | Path):
    from transformers import AutoModelForCausalLM  # GPT2LMHeadModel, or the Llama family's class config.json names

    # MoE families: transformers' default grouped-matmul experts refuse fp64 on CPU; its per-expert loop takes it
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    experts = {"experts_implementation": "eager"} if config.get("num_local_experts") or config.get("num_experts") \
        else {}
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float64, attn_implementation="eager",
                                                 **experts)
    return torch.no_grad()(lambda ids: model.eval()(ids).logits)


def check_export(cfg: ModelConfig, full_state: dict[str, torch.Tensor], hf_dir: str | Path,
                 slices: SliceData | None = None) -> ExportCheck:
    """Hold the HF directory `hf_dir` to the megazoo weights `full_state` (either may be the conversion's output):
    the fixed sample's logits and loss, and (given `slices`) the WikiText / LAMBADA slices scored both ways."""
    ids = fixed_sample(cfg)
    ours_fn, theirs_fn = megazoo_logits_fn(cfg, full_state), hf_dir_logits_fn(hf_dir)
    ours, theirs = ours_fn(ids), theirs_fn(ids)
    if ours.shape != theirs.shape:
        return ExportCheck(tuple(ids.shape), float("inf"), _loss(ours, ids), float("nan"))
    compared = None
    if slices is not None:
        from megazoo.models.hf.convert_slices import SliceComparison, score_slices

        compared = SliceComparison(score_slices(ours_fn, slices, cfg.n_positions),
                                   score_slices(theirs_fn, slices, cfg.n_positions), slices.folder)
    diff = (ours - theirs).abs().max().item()
    return ExportCheck(tuple(ids.shape), diff if diff == diff else float("inf"), _loss(ours, ids),
                       _loss(theirs, ids), compared)
