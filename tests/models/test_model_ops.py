"""The run log's `kernels:` lines name the model's own ops (models/transformer.py: model_ops), as the factories that
build them decide: a Llama-style model's RMSNorm and SwiGLU, not GPT-2's LayerNorm and bias-GELU; each line agrees
with the modules the model is actually built from."""

from __future__ import annotations

import pytest

from megazoo.kernels import KernelChoice, describe_ops, resolve_kernels
from megazoo.kernels.layer_norm import LayerNorm
from megazoo.models.mlp import MLP, SwiGLU
from megazoo.models.norms import RMSNorm
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT, model_ops
from megazoo.parallel.topology import Topology

CONFIGS = {
    "gpt2": ("gpt2-tiny", {}),
    "llama": ("llama-tiny", {}),
    "gpt2-no-mlp-bias": ("gpt2-tiny", {"mlp_bias": False}),
    "llama-sliding-window": ("llama-tiny", {"sliding_window": 8}),
    "gpt2-sparse": ("gpt2-tiny", {"attention": "sparse"}),
}


def _cfg(name: str):
    preset, changes = CONFIGS[name]
    return get_preset(preset).replace(n_layer=1, **changes)


@pytest.mark.parametrize("name, ops", [
    ("gpt2", ["layer_norm", "attention", "bias_gelu", "cross_entropy", "adamw"]),
    ("llama", ["rms_norm", "attention", "swiglu", "cross_entropy", "adamw"]),
    ("gpt2-no-mlp-bias", ["layer_norm", "attention", "gelu", "cross_entropy", "adamw"]),
    ("llama-sliding-window", ["rms_norm", "attention", "sliding_window", "swiglu", "cross_entropy", "adamw"]),
    ("gpt2-sparse", ["layer_norm", "attention", "bias_gelu", "cross_entropy", "adamw"]),
])
def test_the_log_names_each_op_the_model_runs(name, ops):
    cfg = _cfg(name)
    kernels = resolve_kernels(KernelChoice(), "cpu")
    lines = describe_ops(kernels, model_ops(cfg))
    assert [line.split()[1] for line in lines] == ops
    assert all(line.startswith("kernels: ") for line in lines)
    # the model built from the same config runs what the lines say
    block = GPT(cfg, Topology.solo(), kernels=kernels).h["0"]
    assert isinstance(block.ln_1, RMSNorm) == ("rms_norm" in ops)
    assert (isinstance(block.ln_1, LayerNorm) and block.ln_1.fn is kernels["layer_norm"].fn) == ("layer_norm" in ops)
    assert isinstance(block.mlp, SwiGLU) == ("swiglu" in ops)
    assert (isinstance(block.mlp, MLP) and cfg.mlp_bias) == ("bias_gelu" in ops)


def test_a_llama_model_names_no_gpt2_op():
    """The defect: a Llama-style run's log said layer_norm and bias_gelu (in c_fc), ops it never runs."""
    lines = "\n".join(describe_ops(resolve_kernels(None, "cpu"), model_ops(get_preset("llama-tiny"))))
    assert "layer_norm" not in lines and "bias_gelu" not in lines and "gelu" not in lines
    assert "kernels: rms_norm      = model     models/norms.py RMSNorm" in lines
    assert "kernels: swiglu        = model     torch silu(gate) * up" in lines


def test_a_dispatched_op_keeps_its_choice_and_reason():
    kernels = resolve_kernels(KernelChoice("reference"), "cpu")
    (line,) = [x for x in describe_ops(kernels, model_ops(get_preset("gpt2-tiny"))) if " layer_norm " in x]
    assert line == kernels["layer_norm"].line()  # the dispatch's own line: implementation, detail, why
