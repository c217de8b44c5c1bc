"""Psi of one device for a GPT preset under (tp, pp), and the ZeRO plan that follows from it.

The GPT-specific half of the planner. The ZeRO formulas (memory per stage, communication volume, buffers) take
only a parameter count and live, model-agnostic, in recipes/planner/zero.py. Counting a preset's parameters per
tensor/pipeline shard needs three things: the model's parameter layout (models/layout.py), the uniform pipeline
split (parallel/pipeline/partition.py) and those formulas. recipes/ is the layer that may combine models/ and
parallel/ (parallel/ never imports models/; models/ does not import parallel's pipeline or ZeRO code), so this is
its home, beside its command line (recipes/planner/cli.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from megazoo.models.config import ModelConfig
from megazoo.models.layout import check_parallel_compat, parameter_layout
from megazoo.parallel.pipeline.partition import rank_chunks, uniform_stage_layers
from megazoo.recipes.planner.zero import STAGES, Plan, PlanError, plan


@dataclass(frozen=True)
class TensorCount:
    name: str  # the model's parameter name (models/layout.py), e.g. "h.3.attn.c_attn.weight"
    numel: int  # elements on one tp rank
    tp_sharded: bool  # True: 1/tp of the global tensor; False: replicated on every tp rank


@dataclass(frozen=True)
class StageShard:
    """The parameters of one tensor-parallel rank of one pipeline stage."""

    pp_rank: int
    layers: range
    tensors: tuple[TensorCount, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def sharded(self) -> int:
        return sum(t.numel for t in self.tensors if t.tp_sharded)

    @property
    def replicated(self) -> int:
        return sum(t.numel for t in self.tensors if not t.tp_sharded)

    def persistent_elements(self, threshold: int) -> int:
        """Elements in tensors smaller than `threshold` (stage 3 keeps these whole on every dp rank)."""
        return sum(t.numel for t in self.tensors if t.numel < threshold)


@dataclass(frozen=True)
class ModelShard:
    """Per-device parameter counts of a preset under (tp, pp): `psi` is the largest stage's (the peak)."""

    model: str
    tp: int
    pp: int
    padded_vocab: int
    stages: tuple[StageShard, ...]

    @property
    def peak(self) -> StageShard:
        return max(self.stages, key=lambda s: s.numel)  # ties: the first such stage

    @property
    def psi(self) -> int:
        return self.peak.numel

    def persistent_elements(self, threshold: int) -> int:
        """The peak stage's elements in tensors below `threshold` (recipes/planner/zero.py's ShardCounts)."""
        return self.peak.persistent_elements(threshold)

    def unit_elements(self) -> tuple[int, int]:
        """(root unit, largest block) elements of the peak stage: megazoo's stage 3 gathers one unit at a time,
        a block ("h.N.") each, the root holding everything else (embeddings, final LayerNorm)."""
        blocks: dict[str, int] = {}
        for t in self.peak.tensors:
            if t.name.startswith("h."):
                key = t.name.split(".")[1]
                blocks[key] = blocks.get(key, 0) + t.numel
        return self.peak.numel - sum(blocks.values()), max(blocks.values(), default=0)

    def describe(self) -> str:
        peak = self.peak
        sizes = ", ".join(f"{s.numel:,}" for s in self.stages)
        text = (f"Psi = {self.psi:,} parameters per device: {self.model} with tp={self.tp} pp={self.pp}; "
                f"padded vocab {self.padded_vocab:,} (a multiple of 128 x tp); tp-sharded {peak.sharded:,} "
                f"({f'1/{self.tp}' if self.tp > 1 else 'all, at tp=1,'} of the QKV, MLP, attention/MLP output weights, "
                f"column biases and word embedding) "
                f"+ replicated {peak.replicated:,} (LayerNorms, row-parallel biases"
                f"{', position embedding' if peak.pp_rank == 0 else ''})")
        if self.pp > 1:
            text += (f"; pipeline stage {peak.pp_rank} of {self.pp} (blocks {min(peak.layers)}.."
                     f"{max(peak.layers)}) is the largest; every stage: [{sizes}]")
        return text


def shard_parameters(cfg: ModelConfig, tp: int = 1, pp: int = 1, stage_layers=None,
                     placement: str = "loop") -> ModelShard:
    """Exact per-rank parameter counts of `cfg` under tensor parallelism `tp` and pipeline parallelism `pp`.

    Every tensor of models/layout.py's `parameter_layout` for each stage of the uniform pipeline split (tests
    compare names and sizes with a meta-device model):
    - The *padded* vocabulary is counted, since the padded rows are allocated, trained (they get weight decay
      and Adam state) and partitioned like any other row: padded_vocab(tp) / tp rows of wte per tp rank.
    - Column-parallel weights and biases (c_attn in 3 head-aligned sections, mlp.c_fc) and row-parallel weights
      (attn.c_proj, mlp.c_proj) hold 1/tp; row-parallel biases (added after the all-reduce), LayerNorms and the
      position embedding are replicated on every tp rank.
    - Pipeline: stage 0 holds wte and wpe, the last stage ln_f and its own copy of wte for the tied head (so with
      pp > 1 the word embedding is counted on two stages, as it is allocated twice).
    `stage_layers` (a recipe's resolved blocks per (virtual) stage; virtual stage j runs on pp rank j % pp, or
    under zbv's V `placement` on the rank of partition.rank_chunks: rank 0 then holds the first and the last
    stage, embedding and head, with one word embedding for both) replaces the uniform split.
    """
    try:
        check_parallel_compat(cfg, tp, pp)
    except ValueError as err:
        raise PlanError(str(err)) from None
    if stage_layers is None:
        per_rank = uniform_stage_layers(cfg.n_layer, pp)
    else:
        per_rank = [sorted(i for j in rank_chunks(list(stage_layers), pp, r, placement) for i in stage_layers[j])
                    for r in range(pp)]
    head_rank = 0 if placement == "v" and stage_layers is not None else pp - 1
    stages = []
    for rank, layers in enumerate(per_rank):
        params = parameter_layout(cfg, tp, layers=layers, embedding=rank == 0, head=rank == head_rank)
        tensors = tuple(TensorCount(p.name, p.local_numel(tp), p.tp_dim is not None) for p in params)
        stages.append(StageShard(rank, layers, tensors))
    return ModelShard(cfg.name, tp, pp, cfg.padded_vocab(tp), tuple(stages))


def plan_model(cfg: ModelConfig, dp: int, tp: int = 1, pp: int = 1, stages=STAGES, **kwargs) -> Plan:
    """`plan` with Psi = the largest per-device shard of `cfg` under (tp, pp)."""
    shard = shard_parameters(cfg, tp, pp)
    return plan(shard.psi, dp, stages, shard=shard, derivation=shard.describe(), **kwargs)
