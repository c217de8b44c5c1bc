"""`megazoo convert ... --verify`: an export counts once it scores the same.

A fixed sample of token ids (seeded, two sequences of up to 64 tokens) goes through the megazoo GPT built from the
full state and through the Hugging Face GPT2LMHeadModel loaded by transformers from the converted directory (or,
for hf-to-megazoo, through the HF source and the megazoo checkpoint just written), both in fp64 with eager
attention. Compared: the logits (largest absolute difference) and the mean next-token cross-entropy of the sample
(relative difference). In fp64 two correct implementations agree to ~1e-12; a conversion bug (a missed transpose,
permuted heads, a dropped bias) moves logits by orders of magnitude more than the tolerance below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from megazoo.models.config import ModelConfig
from megazoo.models.gpt2.hf import gpt_from_full_state
from megazoo.parallel.topology import Topology

LOGITS_ATOL = 1e-10  # fp64: implementations agree to ~1e-14 on logits of order 1-10
LOSS_RTOL = 1e-10


@dataclass(frozen=True)
class ExportCheck:
    sample: tuple[int, int]  # (sequences, tokens)
    logits_max_abs: float
    loss_megazoo: float
    loss_hf: float

    @property
    def loss_rel(self) -> float:
        return abs(self.loss_megazoo - self.loss_hf) / max(abs(self.loss_hf), 1e-300)

    @property
    def passed(self) -> bool:
        return self.logits_max_abs <= LOGITS_ATOL and self.loss_rel <= LOSS_RTOL

    def table(self) -> str:
        rows = [("logits (max abs difference)", self.logits_max_abs, LOGITS_ATOL),
                ("sample loss (relative difference)", self.loss_rel, LOSS_RTOL)]
        lines = [f"verify: a fixed sample of {self.sample[0]} x {self.sample[1]} tokens through megazoo and "
                 f"through transformers, fp64 (loss: megazoo {self.loss_megazoo:.12g}, HF {self.loss_hf:.12g})",
                 f"  {'quantity':<36}{'deviation':>12}{'tolerance':>11}  result"]
        lines += [f"  {name:<36}{dev:>12.2e}{tol:>11.0e}  {'pass' if dev <= tol else 'FAIL'}" for name, dev, tol in rows]
        return "\n".join(lines)


def fixed_sample(cfg: ModelConfig, sequences: int = 2, tokens: int = 64) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (sequences, min(tokens, cfg.n_positions)),
                         generator=torch.Generator().manual_seed(0))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


@torch.no_grad()
def megazoo_logits(cfg: ModelConfig, full_state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    model = gpt_from_full_state(cfg, full_state, Topology.solo(), dtype=torch.float64)
    return model(ids)[..., : cfg.vocab_size]  # drop the padded vocabulary's columns


@torch.no_grad()
def hf_dir_logits(hf_dir: str | Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM  # GPT2LMHeadModel, or the Llama family's class config.json names

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float64, attn_implementation="eager")
    return model.eval()(ids).logits


def check_export(cfg: ModelConfig, full_state: dict[str, torch.Tensor], hf_dir: str | Path) -> ExportCheck:
    """Hold the HF directory `hf_dir` to the megazoo weights `full_state` (either may be the conversion's output)."""
    ids = fixed_sample(cfg)
    ours, theirs = megazoo_logits(cfg, full_state, ids), hf_dir_logits(hf_dir, ids)
    if ours.shape != theirs.shape:
        return ExportCheck(tuple(ids.shape), float("inf"), _loss(ours, ids), float("nan"))
    diff = (ours - theirs).abs().max().item()
    return ExportCheck(tuple(ids.shape), diff if diff == diff else float("inf"), _loss(ours, ids), _loss(theirs, ids))
