"""DeepSeek-V3's multi-token prediction (MTP, the report's section 2.2), on the last pipeline stage.

Depth k (1..D) keeps a causal chain: at position i it takes the previous depth's hidden state h^{k-1}_i (the
main model's last block output for k = 1) and the embedding of token t_{i+k}, RMS-normalises each (`hnorm`,
`enorm`), projects [h; e] from 2d to d (`eh_proj`), runs one transformer block of the decoder (models/
transformer.py's Block, MoE or dense as the config's layer n_layer + k - 1 would be) and predicts t_{i+k+1}
through its own final norm (`norm`) and the main model's head. The embedding and the head are the main model's
(shared parameters: on a last pipeline stage the embedding is a copy whose gradient is summed with the first
stage's, as a tied embedding's). Training loss: main + mtp_loss_weight / D x sum_k CE_k, each CE_k the mean over
the positions whose target t_{i+k+1} exists (the sequence's last k targets are ignored).

From the batch alone: the micro-batch's inputs x_0..x_{s-1} and targets y_i = x_{i+1}. Depth k's embedded tokens
are x shifted left by k (x_{i+k}) and its targets y shifted left by k (y_{i+k} = t_{i+k+1}); the positions past
the end embed id 0 and are ignored. So the last stage needs only the inputs beside the targets (the Trainer
passes them), and sequence parallelism splits the embedding's output like the main embedding's.

Shapes: b batch, s sequence (s / tp under sequence parallelism), d d_model.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.models.config import ModelConfig
from megazoo.models.norms import RMSNorm
from megazoo.parallel.tensor import SequenceParallel

IGNORE = -100


def shift_left(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """(b, s) -> (b, s): t[:, i + k], `fill` past the end."""
    if k == 0:
        return t
    return torch.cat([t[:, k:], t.new_full((t.shape[0], min(k, t.shape[1])), fill)], dim=1)


class MTPLayer(nn.Module):
    """One depth: hnorm, enorm, eh_proj (2d -> d, replicated over tp), one block, its final norm."""

    def __init__(self, cfg: ModelConfig, block: nn.Module, sequence_parallel: SequenceParallel, device=None,
                 dtype=None):
        super().__init__()
        d, eps = cfg.d_model, cfg.layer_norm_eps
        sp = sequence_parallel if sequence_parallel.enabled else None
        # RMSNorms as DeepSeek-V3 (whatever the decoder's norm): the report's RMSNorm on both inputs
        self.hnorm = RMSNorm(d, eps, device=device, dtype=dtype, sequence_parallel=sp)
        self.enorm = RMSNorm(d, eps, device=device, dtype=dtype, sequence_parallel=sp)
        self.eh_proj = nn.Linear(2 * d, d, bias=False, device=device, dtype=dtype)
        self.block = block
        self.norm = RMSNorm(d, eps, device=device, dtype=dtype, sequence_parallel=sp)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, cache=None) -> torch.Tensor:
        """hidden, embedded (b, s, d) -> this depth's hidden state (b, s, d), before its final norm. `cache`: the
        block's LayerCache when drafting (models/deepseek/speculative.py)."""
        x = torch.cat([self.hnorm(hidden), self.enorm(embedded)], dim=-1)
        # Replicated over tp; under sequence parallelism each rank projects its own positions, so the weight's
        # gradient is summed over tp (replicated(): identity forward, all-reduce backward).
        x = F.linear(x, self.sequence_parallel.replicated(self.eh_proj.weight))
        return self.block(x) if cache is None else self.block(x, cache)


class MTP(nn.Module):
    """mtp_depth MTPLayers, keyed "0".."D-1" (depth k is key k - 1). `make_block(index)` builds the decoder's
    block for layer `index` (n_layer + k - 1), so the MTP block is MoE exactly where that layer would be."""

    def __init__(self, cfg: ModelConfig, make_block: Callable[[int], nn.Module], sequence_parallel: SequenceParallel,
                 device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleDict({str(k): MTPLayer(cfg, make_block(cfg.n_layer + k), sequence_parallel,
                                                      device=device, dtype=dtype) for k in range(cfg.mtp_depth)})

    def forward(self, hidden: torch.Tensor, inputs: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                depths: int | None = None, run: Callable | None = None) -> list[torch.Tensor]:
        """Each depth's normalised output (b, s, d), to go through the shared head. `embed` (b, s) ids ->
        (b, s, d) embeddings split like `hidden`; `depths`: run only the first ones (speculative drafting);
        `run(layer, hidden, embedded)`: how a depth runs (activation checkpointing: recomputed in backward, keeping
        its two inputs only, as the decoder's blocks)."""
        out = []
        for k, layer in enumerate(list(self.layers.values())[:depths], start=1):
            embedded = embed(shift_left(inputs, k, 0))
            hidden = layer(hidden, embedded) if run is None else run(layer, hidden, embedded)
            out.append(layer.norm(hidden))
        return out


def mtp_targets(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth `depth`'s targets t_{i+depth+1} from the main targets t_{i+1}: shifted left, ignored past the end."""
    return shift_left(targets, depth, IGNORE)
