"""models/layout.py: the one description of the model's parameters, and the one (tp, pp) compatibility check.

The layout is held equal to what a meta-device model really allocates (names, global shapes, tp split dim and
sections, local shapes), for every preset at tp = 1, for pipeline stages, and at tp = 2 on two gloo ranks. The
compatibility check reads the same from the model, the recipe resolver and the planner.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import run_distributed
from recipe_helpers import tiny_recipe

from megazoo.models.config import ARCHITECTURE_FIELDS, ModelConfig, architecture_mismatches, model_fields
from megazoo.models.presets import get_preset, presets
from megazoo.models.hf.gpt2 import expected_shapes
from megazoo.models.layout import check_parallel_compat, divisors, parameter_layout
from megazoo.models.transformer import GPT
from megazoo.models.weights import named_shards
from megazoo.parallel.pipeline.partition import uniform_stage_layers
from megazoo.parallel.topology import Topology
from megazoo.recipes.planner.zero import PlanError
from megazoo.recipes.config import RecipeError
from megazoo.recipes.planner.shards import shard_parameters
from megazoo.recipes.resolve import resolve


def _allocated(model: GPT) -> list[tuple]:
    """(name, global shape, tp dim, sections, local shape) of every parameter the model allocates, in order."""
    return [(name, tuple(spec.global_shape), spec.dim, spec.sections if spec.dim is not None else 1,
             tuple(param.shape)) for name, param, spec in named_shards(model)]


def _described(cfg: ModelConfig, tp: int, **stage) -> list[tuple]:
    return [(p.name, p.shape, p.tp_dim, p.sections, p.local_shape(tp)) for p in parameter_layout(cfg, tp, **stage)]


@pytest.mark.parametrize("name", sorted(presets()))
def test_layout_is_what_the_model_allocates(name):
    cfg = get_preset(name)
    assert _described(cfg, 1) == _allocated(GPT(cfg, Topology.solo(), device="meta"))
    assert cfg.num_parameters() == sum(p.numel for p in parameter_layout(cfg, vocab=cfg.vocab_size))
    assert cfg.num_parameters(cfg.padded_vocab(1)) == sum(p.numel for p in parameter_layout(cfg))


@pytest.mark.parametrize("pp", [2, 3])
def test_layout_of_pipeline_stages(pp):
    cfg = get_preset("gpt2-tiny")
    for rank, layers in enumerate(uniform_stage_layers(cfg.n_layer, pp)):
        stage = dict(layers=layers, embedding=rank == 0, head=rank == pp - 1)
        model = GPT(cfg, Topology.solo(), layers=layers, with_embedding=rank == 0, with_head=rank == pp - 1,
                    device="meta")
        assert _described(cfg, 1, **stage) == _allocated(model)


def _tp2_allocated(pp: int):
    cfg, topo = get_preset("gpt2-tiny").replace(vocab_size=300), Topology.build(dp=1, tp=2)
    out = []
    for rank, layers in enumerate(uniform_stage_layers(cfg.n_layer, pp)):
        out.append(_allocated(GPT(cfg, topo, layers=layers, with_embedding=rank == 0, with_head=rank == pp - 1,
                                  device=torch.device("meta"))))
    return out


def test_layout_at_tp2_is_what_two_ranks_allocate():
    cfg, pp = get_preset("gpt2-tiny").replace(vocab_size=300), 2
    described = [_described(cfg, 2, layers=layers, embedding=rank == 0, head=rank == pp - 1)
                 for rank, layers in enumerate(uniform_stage_layers(cfg.n_layer, pp))]
    assert described[0][0][1] == (cfg.padded_vocab(2), cfg.d_model)  # the padded vocabulary, split over tp
    for measured in run_distributed(_tp2_allocated, 2, pp):
        assert measured == described


def test_hf_expected_shapes_come_from_the_layout_at_the_true_vocabulary():
    cfg = get_preset("gpt2-117m")
    shapes = expected_shapes(cfg)
    assert shapes["wte.weight"] == (cfg.vocab_size, cfg.d_model) and len(shapes) == 2 + 12 * cfg.n_layer + 2
    assert sum(torch.Size(s).numel() for s in shapes.values()) == cfg.num_parameters() == 124_439_808


def test_d_ff_is_described_too():
    cfg = get_preset("gpt2-tiny").replace(d_ff=200)
    shapes = {p.name: p.shape for p in parameter_layout(cfg)}
    assert shapes["h.0.mlp.c_fc.weight"] == (200, cfg.d_model) and shapes["h.3.mlp.c_proj.weight"] == (cfg.d_model, 200)
    assert _described(cfg, 1) == _allocated(GPT(cfg, Topology.solo(), device="meta"))


# ---- the (tp, pp) check ----------------------------------------------------------------------------------------

def test_divisors():
    assert divisors(28) == [1, 2, 4, 7, 14, 28] and divisors(1) == [1]


def test_compat_messages_name_the_field_the_value_and_what_is_valid():
    tnlg = get_preset("tnlg-17b")
    check_parallel_compat(tnlg, 28, 78)
    with pytest.raises(ValueError) as err:
        check_parallel_compat(tnlg, 8, 1)
    message = str(err.value)
    for needle in ("parallel.tp = 8", "28 attention heads", "tnlg-17b", "n_head = 28", "[1, 2, 4, 7, 14, 28]",
                   "valid tp: 1, 2, 4, 7, 14, 28"):
        assert needle in message, (needle, message)
    with pytest.raises(ValueError, match=r"parallel.pp = 5 is larger than the number of blocks of gpt2-tiny "
                                         r"\(model.n_layer = 4 blocks\); valid pp: 1..4"):
        check_parallel_compat(get_preset("gpt2-tiny"), 1, 5)
    odd_mlp = get_preset("gpt2-tiny").replace(d_ff=6)  # heads 4: tp 4 divides them, but not the MLP width 6
    with pytest.raises(ValueError, match=r"parallel.tp = 4 does not divide the MLP width .*d_ff = 6.*valid tp: 1, 2$"):
        check_parallel_compat(odd_mlp, 4)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match=f"parallel.tp = {bad!r} is invalid"):
            check_parallel_compat(tnlg, bad)


def test_model_resolver_and_planner_report_a_bad_layout_alike():
    tnlg = get_preset("tnlg-17b")
    with pytest.raises(ValueError) as direct:
        check_parallel_compat(tnlg, 8, 1)
    with pytest.raises(ValueError) as model:
        GPT(tnlg, Topology(tp=8, tp_rank=0), device="meta")
    with pytest.raises(RecipeError) as recipe:
        resolve(tiny_recipe(model={"preset": "tnlg-17b", "vocab_size": None}, parallel={"tp": 8}))
    with pytest.raises(PlanError) as planned:
        shard_parameters(tnlg, 8)
    assert str(direct.value) == str(model.value) == str(recipe.value) == str(planned.value)


# ---- architecture_mismatches -----------------------------------------------------------------------------------

def test_architecture_fields_are_model_fields():
    assert set(ARCHITECTURE_FIELDS) <= set(model_fields())
    assert set(ARCHITECTURE_FIELDS) == {"n_layer", "n_head", "d_model", "d_ff", "vocab_size", "n_positions",
                                        "n_kv_head", "norm", "positions", "mlp", "tie_embeddings", "qkv_bias",
                                        "proj_bias", "mlp_bias", "head_width", "qk_norm", "n_experts", "moe_d_ff",
                                        "moe_shared_experts", "moe_shared_d_ff", "moe_shared_gate",
                                        "moe_first_dense", "moe_every", "moe_dense_layers",
                                        "moe_router",  # sigmoid_bias adds router.expert_bias
                                        "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                        "v_head_dim", "mtp_depth"}  # latent attention's shapes, the MTP modules


def test_architecture_mismatches():
    small = dataclasses.asdict(get_preset("gpt2-tiny").replace(n_layer=2))
    base = dataclasses.asdict(get_preset("gpt2-117m"))
    assert architecture_mismatches(base, base) == []
    # dropout, init and the name do not change parameter shapes
    other = dataclasses.asdict(get_preset("gpt2-117m").replace(name="mine", dropout=0.0, init_std=0.01))
    assert architecture_mismatches(base, other) == []
    assert architecture_mismatches(small, base) == [
        "model.n_layer = 2 there, 12 here", "model.n_head = 4 there, 12 here", "model.d_model = 128 there, 768 here",
        "model.d_ff = 512 there, 3072 here", "model.n_positions = 256 there, 1024 here",
        "model.n_kv_head = 4 there, 12 here"]
    wider = dataclasses.asdict(get_preset("gpt2-117m").replace(d_ff=1000, vocab_size=300))
    assert architecture_mismatches(base, wider) == ["model.d_ff = 3072 there, 1000 here",
                                                    "model.vocab_size = 50257 there, 300 here"]
    old = {k: v for k, v in base.items() if k != "d_ff"}
    assert architecture_mismatches(old, base) == ["model.d_ff = (not recorded) there, 3072 here"]
    # a checkpoint from before the architecture options has GPT-2's block: it matches a GPT-2 config
    before = {k: v for k, v in base.items() if k not in ("norm", "positions", "mlp", "n_kv_head", "tie_embeddings",
                                                          "qkv_bias", "proj_bias", "mlp_bias")}
    assert architecture_mismatches(before, base) == []
    llama = dataclasses.asdict(get_preset("llama-tiny"))
    gpt = dataclasses.asdict(get_preset("llama-tiny").replace(norm="layernorm", n_kv_head=4))
    assert architecture_mismatches(llama, gpt) == ["model.n_kv_head = 2 there, 4 here",
                                                   "model.norm = rmsnorm there, layernorm here"]


# ---- the Llama-style layout: GQA split or replicated over tp, SwiGLU, untied head -------------------------------

LLAMA = get_preset("llama-tiny").replace(vocab_size=300, n_layer=2)


def test_llama_layout_names_and_shapes():
    shapes = {p.name: (p.shape, p.tp_dim, p.sections) for p in parameter_layout(LLAMA, vocab=300)}
    d, hd = LLAMA.d_model, LLAMA.head_dim
    assert shapes["h.0.attn.c_q.weight"] == ((4 * hd, d), 0, 1)
    assert shapes["h.0.attn.c_kv.weight"] == ((2 * 2 * hd, d), 0, 2)  # [K; V] of 2 key/value heads
    assert shapes["h.1.mlp.c_fc.weight"] == ((2 * 344, d), 0, 2)  # [gate; up]
    assert shapes["lm_head.weight"] == ((300, d), 0, 1) and "wpe.weight" not in shapes
    assert not any(name.endswith("bias") for name in shapes) and "ln_f.weight" in shapes
    # tp 4 > 2 key/value heads: c_kv replicated on every rank
    assert {p.name: p.tp_dim for p in parameter_layout(LLAMA, 4)}["h.0.attn.c_kv.weight"] is None
    qwen = get_preset("qwen2.5-7b")
    names = {p.name for p in parameter_layout(qwen)}
    assert "h.0.attn.c_q.bias" in names and "h.0.attn.c_kv.bias" in names and "h.0.attn.c_proj.bias" not in names


def _llama_allocated(tp: int, pp: int):
    topo = Topology.build(dp=1, tp=tp)
    return [_allocated(GPT(LLAMA, topo, layers=layers, with_embedding=rank == 0, with_head=rank == pp - 1,
                           device=torch.device("meta")))
            for rank, layers in enumerate(uniform_stage_layers(LLAMA.n_layer, pp))]


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_layout_at_tp_is_what_the_ranks_allocate(tp):
    pp = 2
    described = [_described(LLAMA, tp, layers=layers, embedding=rank == 0, head=rank == pp - 1)
                 for rank, layers in enumerate(uniform_stage_layers(LLAMA.n_layer, pp))]
    for measured in run_distributed(_llama_allocated, tp, tp, pp):
        assert measured == described


def test_gqa_compat_message():
    cfg = get_preset("llama-tiny").replace(n_head=12, n_kv_head=3, d_model=96, d_ff=48)  # tp 2: neither divides nor multiple
    check_parallel_compat(cfg, 3)
    check_parallel_compat(cfg, 6)
    with pytest.raises(ValueError, match=r"parallel.tp = 2 neither divides nor is a multiple of the 3 key/value "
                                         r"heads .*model.n_kv_head = 3.*valid tp: 1, 3, 6, 12$"):
        check_parallel_compat(cfg, 2)
