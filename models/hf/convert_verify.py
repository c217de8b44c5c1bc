"""`megazoo convert ... --verify`: an export counts once it scores the same.

A fixed sample of token ids (seeded, two sequences of up to 64 tokens) goes through the megazoo GPT built from the
full state and through the Hugging Face model loaded by transformers from the converted directory (or, for
hf-to-megazoo, through the HF source and the megazoo checkpoint just written), both in fp64 with eager attention.
Compared: the logits (largest absolute difference) and the mean next-token cross-entropy of the sample (relative
difference).

The tolerance, derived per family (`fp32_floor` below):
- GPT-2: transformers' GPT2LMHeadModel computes in fp64 throughout, so two correct implementations differ only by
  fp64 reduction order, ~1e-14 on logits of order 1-10: logits 1e-10 absolute, loss 1e-10 relative.
- Llama / Qwen2 / Mistral (every family whose key map sets `fp32_in_hf`): transformers rounds to fp32 inside an
  fp64 model. Its RMSNorm casts the activations to fp32 (`hidden_states.to(torch.float32)`) and back only after
  normalising, and its rotary embedding computes angles and their cos / sin in fp32 (an angle p * w carries an
  error up to p * 2^-24 rad: 4e-6 at position 63); ours keeps fp64 there. So the two sides differ by fp32 rounding
  at those points, ~1e-7 on these logits, far above 1e-10. The floor of fp32 rounding for *this* model on *this*
  sample is measured directly: the same megazoo weights run in fp32 and in fp64, `floor = max |logits_fp32 -
  logits_fp64|` (and likewise the loss). fp32 everywhere rounds at every operation, a superset of the points
  where transformers rounds, so transformers' deviation sits below it (measured on tiny Llama / Qwen2 / Mistral
  / Llama-3.1-scaled models: 0.22-0.39 of the floor); the logits' tolerance is 2 x floor (at least 1e-10), the
  loss's is what that bound allows (2 x the logits' tolerance, relative to the loss: see check_export). The floor is
  computed from the megazoo side's weights alone, so a broken conversion cannot widen it: a transposed projection
  (~1e6 x the tolerance), q/k heads swapped (~2e4 x), a rope theta off by 10x or a dropped llama3 scaling
  (~1e3-1e4 x) are refused (tests/models/hf/test_verify_families.py).
The WikiText / LAMBADA slices (convert_slices.py) follow the same rule: their megazoo fp32 scores give the floor.
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

LOGITS_ATOL = 1e-10  # fp64 throughout: implementations agree to ~1e-14 on logits of order 1-10
LOSS_RTOL = 1e-10
FLOOR_FACTOR = 2.0  # tolerance = FLOOR_FACTOR x the model's own fp32-vs-fp64 deviation (families rounding to fp32)


def fp32_in_hf(cfg: ModelConfig) -> bool:
    """Whether transformers' implementation of `cfg`'s family rounds to fp32 inside an fp64 model (the key map's
    `fp32_in_hf`: RMSNorm and rotary families do, GPT-2 does not)."""
    from megazoo.models.hf.families import family_of_config

    return family_of_config(cfg).fp32_in_hf


@dataclass(frozen=True)
class ExportCheck:
    sample: tuple[int, int]  # (sequences, tokens)
    logits_max_abs: float
    loss_megazoo: float
    loss_hf: float
    slices: SliceComparison | None = None  # the WikiText / LAMBADA slices (convert_slices.py), when data was found
    logits_atol: float = LOGITS_ATOL
    loss_rtol: float = LOSS_RTOL
    floor: bool = False  # tolerances from the model's fp32 floor (module docstring) rather than fp64's

    @property
    def loss_rel(self) -> float:
        return abs(self.loss_megazoo - self.loss_hf) / max(abs(self.loss_hf), 1e-300)

    @property
    def passed(self) -> bool:
        sample_ok = self.logits_max_abs <= self.logits_atol and self.loss_rel <= self.loss_rtol
        return sample_ok and (self.slices is None or self.slices.passed)

    def table(self) -> str:
        rows = [("logits (max abs difference)", self.logits_max_abs, self.logits_atol),
                ("sample loss (relative difference)", self.loss_rel, self.loss_rtol)]
        how = (f"tolerance {FLOOR_FACTOR:g} x this model's fp32-vs-fp64 deviation: transformers rounds RMSNorm and "
               "rotary to fp32" if self.floor else "tolerance: fp64 reduction order")
        lines = [f"verify: a fixed sample of {self.sample[0]} x {self.sample[1]} tokens through megazoo and "
                 f"through transformers, fp64 (loss: megazoo {self.loss_megazoo:.12g}, HF {self.loss_hf:.12g}; "
                 f"{how})",
                 f"  {'quantity':<36}{'deviation':>12}{'tolerance':>11}  result"]
        lines += [f"  {name:<36}{dev:>12.2e}{tol:>11.2e}  {'pass' if dev <= tol else 'FAIL'}"
                  for name, dev, tol in rows]
        return "\n".join(lines + ([self.slices.table()] if self.slices is not None else []))


def fixed_sample(cfg: ModelConfig, sequences: int = 2, tokens: int = 64) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (sequences, min(tokens, cfg.n_positions)),
                         generator=torch.Generator().manual_seed(0))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


def megazoo_logits_fn(cfg: ModelConfig, full_state, dtype: torch.dtype = torch.float64):
    """ids -> fp64 logits of the megazoo GPT holding `full_state` (a dict, or a lazy mapping read name by name)
    computed in `dtype`."""
    model = gpt_from_full_state(cfg, full_state, Topology.solo(), dtype=dtype)
    return torch.no_grad()(lambda ids: model(ids)[..., : cfg.vocab_size].double())  # padded vocabulary dropped


def hf_dir_logits_fn(hf_dir: str | Path):
    from transformers import AutoModelForCausalLM  # GPT2LMHeadModel, or the Llama family's class config.json names

    # MoE families: transformers' default grouped-matmul experts refuse fp64 on CPU; its per-expert loop takes it
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    experts = {"experts_implementation": "eager"} if config.get("num_local_experts") or config.get("num_experts") \
        or config.get("n_routed_experts") \
        else {}
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float64, attn_implementation="eager",
                                                 **experts)
    return torch.no_grad()(lambda ids: model.eval()(ids).logits)


def check_export(cfg: ModelConfig, full_state, hf_dir: str | Path,
                 slices: SliceData | None = None) -> ExportCheck:
    """Hold the HF directory `hf_dir` to the megazoo weights `full_state` (either may be the conversion's output):
    the fixed sample's logits and loss, and (given `slices`) the WikiText / LAMBADA slices scored both ways."""
    ids = fixed_sample(cfg)
    ours_fn, theirs_fn = megazoo_logits_fn(cfg, full_state), hf_dir_logits_fn(hf_dir)
    ours, theirs = ours_fn(ids), theirs_fn(ids)
    if ours.shape != theirs.shape:
        return ExportCheck(tuple(ids.shape), float("inf"), _loss(ours, ids), float("nan"))
    floor = fp32_in_hf(cfg)
    atol, rtol, floor_fn = LOGITS_ATOL, LOSS_RTOL, None
    if floor:
        floor_fn = megazoo_logits_fn(cfg, full_state, torch.float32)
        ours32 = floor_fn(ids)
        atol = max(LOGITS_ATOL, FLOOR_FACTOR * (ours32 - ours).abs().max().item())
        # The loss's bound follows from the logits' one: a token's cross-entropy moves by at most 2 x the largest
        # change of its logits (log-sum-exp moves by at most that change, the target's logit by at most it too).
        # The loss's own fp32-vs-fp64 difference is no floor: over the sample's mean its roundings can cancel to
        # near zero by chance (a tiny Mixtral: 1.5e-10 relative, while transformers' correct rounding moved it 2.4e-10).
        rtol = max(LOSS_RTOL, 2 * atol / abs(_loss(ours, ids)))
    compared = None
    if slices is not None:
        from megazoo.models.hf.convert_slices import SliceComparison, score_slices

        scores = [score_slices(fn, slices, cfg.n_positions) for fn in (ours_fn, theirs_fn)]
        floor_scores = score_slices(floor_fn, slices, cfg.n_positions) if floor_fn is not None else None
        compared = SliceComparison(*scores, slices.folder, floor=floor_scores)
    diff = (ours - theirs).abs().max().item()
    return ExportCheck(tuple(ids.shape), diff if diff == diff else float("inf"), _loss(ours, ids),
                       _loss(theirs, ids), compared, atol, rtol, floor)
