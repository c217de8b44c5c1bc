"""Fused kernels behind one dispatch: apex when importable, torch fused ops, Triton, plain reference.

    from megazoo.kernels import KernelChoice, resolve_kernels
    kernels = resolve_kernels(KernelChoice(prefer="auto"), device)   # {op: Implementation}, .describe()

Ops (kernels/dispatch.py lists each op's implementations, best first): layer_norm, bias_gelu, attention (SDPA, or
q k^T + scaled causal softmax + p v), cross_entropy (vocab-parallel, chunked / fused), adamw (on flat fp32
tensors). Our Triton kernels are kernels/triton_*.py, each tested against the reference beside it.
"""

from megazoo.kernels.dispatch import (MODEL_DEFAULTS, OPS, PREFER, Implementation, KernelChoice, KernelError, Kernels,
                              ModelOp, describe, describe_ops, implementations, kernels_for_model, model_defaults,
                              resolve_kernels)
from megazoo.kernels.layer_norm import LayerNorm

__all__ = ["MODEL_DEFAULTS", "OPS", "PREFER", "Implementation", "KernelChoice", "KernelError", "Kernels",
           "LayerNorm", "ModelOp", "describe", "describe_ops", "implementations", "kernels_for_model",
           "model_defaults", "resolve_kernels"]
