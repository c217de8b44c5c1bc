"""The block's MLP: GPT-2's tanh-GELU (d -> d_ff -> d) or Llama's SwiGLU (Shazeer 2020: down(silu(gate x) * up x)).

Both are a column-parallel c_fc (identity forward, all-reduce of dx in backward) and a row-parallel c_proj
(all-reduce in forward); under sequence parallelism an all-gather and a reduce-scatter along the sequence. SwiGLU's c_fc is [gate; up] in 2 sections, so rank r holds [gate_r; up_r], the rows of
the same d_ff / tp hidden units: the gating is elementwise on the local slice and needs no communication.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazoo.kernels import Implementation, ModelOp, kernels_for_model
from megazoo.models.attention import residual_std
from megazoo.models.config import ModelConfig
from megazoo.parallel.tensor import ColumnParallelLinear, RowParallelLinear, SequenceParallel
from megazoo.parallel.topology import Topology


class MLP(nn.Module):
    """d -> d_ff column-parallel, tanh-GELU on the local slice, d_ff -> d row-parallel (one all-reduce)."""

    def __init__(self, cfg: ModelConfig, topo: Topology, device=None, dtype=None, *,
                 kernels: Mapping[str, Implementation] | None = None, sequence_parallel: SequenceParallel | None = None):
        super().__init__()
        bias_gelu = kernels_for_model(kernels)["bias_gelu"]
        # torch: cuBLAS / MKL add c_fc's bias inside the GEMM (addmm) for free, then torch's GELU kernel. The fused
        # kernels instead take the bias: c_fc runs its matmul only (same parameters, names and shapes).
        self.bias_gelu = None if bias_gelu.name == "torch" or not cfg.mlp_bias else bias_gelu.fn
        self.c_fc = ColumnParallelLinear(cfg.d_model, cfg.d_ff, topo.tp_group, bias=cfg.mlp_bias,
                                         init_std=cfg.init_std, device=device, dtype=dtype,
                                         sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear(cfg.d_ff, cfg.d_model, topo.tp_group, bias=cfg.mlp_bias,
                                        init_std=residual_std(cfg), device=device, dtype=dtype,
                                        sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias_gelu is None:
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        assert not self.c_fc.gather_output  # the local slice (b, s, d_ff/tp), as ColumnParallelLinear.forward
        if self.c_fc.lora is None and self.c_fc.fp8 is None:
            (h,) = self.c_fc.sequence_parallel.linears(x, (self.c_fc.weight, None))
        else:
            h = self.c_fc.local(self.c_fc.sequence_parallel.enter(x), bias=False)  # (+ its LoRA adapters)
        return self.c_proj(self.bias_gelu(h, self.c_fc.bias))


class SwiGLU(nn.Module):
    """d -> [gate; up] (2 d_ff) column-parallel, silu(gate) * up on the local slice, d_ff -> d row-parallel."""

    def __init__(self, cfg: ModelConfig, topo: Topology, device=None, dtype=None, *,
                 sequence_parallel: SequenceParallel | None = None):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.d_model, 2 * cfg.d_ff, topo.tp_group, sections=2, bias=cfg.mlp_bias,
                                         init_std=cfg.init_std, device=device, dtype=dtype,
                                         sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear(cfg.d_ff, cfg.d_model, topo.tp_group, bias=cfg.mlp_bias,
                                        init_std=residual_std(cfg), device=device, dtype=dtype,
                                        sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, d) -> (b, s, d)
        gate, up = self.c_fc(x).chunk(2, dim=-1)  # 2 x (b, s, d_ff/tp)
        return self.c_proj(F.silu(gate) * up)


def mlp_ops(cfg: ModelConfig) -> tuple[ModelOp, ...]:
    """What make_mlp runs for `cfg`, for the run log's kernels: lines (models/transformer.py: model_ops)."""
    if cfg.mlp == "swiglu":
        return (ModelOp("swiglu", fixed="torch silu(gate) * up on c_fc's local [gate; up] slice (models/mlp.py)"),)
    if not cfg.mlp_bias:  # MLP: no c_fc bias to fuse, so the bias_gelu kernel is never called
        return (ModelOp("gelu", fixed="torch.nn.functional.gelu(approximate='tanh') (c_fc has no bias to fuse)"),)
    return (ModelOp("bias_gelu", "bias_gelu"),)


def make_mlp(cfg: ModelConfig, topo: Topology, device=None, dtype=None, *,
             kernels: Mapping[str, Implementation] | None = None,
             sequence_parallel: SequenceParallel | None = None) -> nn.Module:
    if cfg.mlp == "swiglu":
        return SwiGLU(cfg, topo, device=device, dtype=dtype, sequence_parallel=sequence_parallel)
    return MLP(cfg, topo, device=device, dtype=dtype, kernels=kernels, sequence_parallel=sequence_parallel)
