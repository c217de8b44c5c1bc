"""HF LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM <-> megazoo: logits equal transformers' own
implementation (tiny configs, random weights, no download) to 1e-5 in fp32 at tp = 1 and tp = 2, split into two
pipeline stages, and under context parallelism cp = 2 (ring and all-to-all; rotary at each rank's load-balanced
chunks), and the
conversion round trip (HF -> megazoo -> HF) gives identical tensors, in memory and through `megazoo convert`
(which carries the HF directory's tokenizer inside the checkpoint and writes it back).

The configs exercise what each family adds: Llama 3.1's llama3 rope scaling (its original context set below the
test's length so every frequency band is hit) and an untied head; Qwen2's q/k/v bias and a tied head; Mistral's
sliding window shorter than the sequence. All use grouped-query attention (4 query heads, 2 key/value heads).
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
import transformers
from harness import run_distributed
from hf_helpers import DENSE_FAMILIES as FAMILIES, FAMILY_VOCAB as V
from hf_helpers import tiny_family_config, tiny_family_model, tiny_hf_tokenizer

from megazoo.models.hf.gpt2 import gpt_from_full_state
from megazoo.models.hf.llama import (config_from_hf, config_to_hf, hf_family, hf_to_megazoo_state,
                                     megazoo_to_hf_state)
from megazoo.parallel.tensor import gather_from_tp_region
from megazoo.parallel.topology import Topology

TOL = 1e-5
IDS = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(3))


@functools.lru_cache(maxsize=None)
def hf_model(family: str):
    return tiny_family_model(family)


@functools.lru_cache(maxsize=None)
def hf_logits(family: str) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(family)(IDS).logits


def _our_logits(topo: Topology, cfg, full):
    model = gpt_from_full_state(cfg, full, topo)
    with torch.no_grad():
        return gather_from_tp_region(model(IDS), topo.tp_group)[..., :V]


def converted(family: str):
    model = hf_model(family)
    cfg = config_from_hf(model.config, name=f"tiny-{family}")
    return cfg, hf_to_megazoo_state(model.state_dict(), cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_maps_each_family(family):
    cfg, full = converted(family)
    assert hf_family(cfg) == family
    assert (cfg.n_kv_head, cfg.norm, cfg.positions, cfg.mlp) == (2, "rmsnorm", "rotary", "swiglu")
    assert cfg.qkv_bias == (family == "qwen2") and cfg.tie_embeddings == (family == "qwen2")
    assert cfg.sliding_window == (6 if family == "mistral" else 0)
    assert cfg.rope_scaling == ("llama3" if family == "llama" else "none")
    assert cfg.num_parameters() == sum(p.numel() for p in hf_model(family).parameters())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_equal_transformers(family, tp):
    cfg, full = converted(family)
    ref = hf_logits(family)
    if tp == 1:
        outs = [_our_logits(Topology.solo(), cfg, full)]
    else:
        outs = run_distributed(lambda: _our_logits(Topology.build(dp=1, tp=tp), cfg, full), tp)
    for ours in outs:
        deviation = (ours - ref).abs().max().item()
        assert deviation < TOL, f"{family} tp={tp}: max |logit difference| {deviation:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_gives_identical_tensors(family):
    model = hf_model(family)
    cfg, full = converted(family)
    back = megazoo_to_hf_state(full, cfg)
    theirs = {k: v for k, v in model.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    assert back.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(back[name], tensor), name
    # and the config: the exported one builds a model with the same parameter names and shapes
    again = config_from_hf(config_to_hf(cfg), name=cfg.name)
    assert again == cfg


def _llama_config(**changes):
    config = tiny_family_config("llama")
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_unsupported_variants_are_refused():
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        config_from_hf(_llama_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        config_from_hf(_llama_config(rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=32)))
    cfg, full = converted("llama")
    del full["h.1.mlp.c_fc.weight"]
    with pytest.raises(ValueError, match="unexpected"):
        megazoo_to_hf_state({**full, "extra.weight": torch.zeros(1)}, cfg)
    state = dict(hf_model("llama").state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\).*model.layers.1.mlp.up_proj.weight"):
        hf_to_megazoo_state(state, cfg)


def _cli(argv):
    import argparse

    from megazoo.models.hf.convert_cli import register

    parser = argparse.ArgumentParser(prog="megazoo")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_convert_cli_round_trip(family, tmp_path, capsys):
    """HF dir -> `megazoo convert hf-to-megazoo` -> `megazoo-to-hf` -> transformers loads it: same class,
    identical tensors, same logits."""
    from safetensors.torch import load_file

    source, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    hf_model(family).save_pretrained(str(source))
    tokenizer = tiny_hf_tokenizer()
    tokenizer.save_pretrained(str(source))
    assert _cli(["convert", "hf-to-megazoo", str(source), "--out", str(ckpt)]) == 0
    assert f"converted HF {family}" in capsys.readouterr().out
    theirs = load_file(str(source / "model.safetensors"))
    shutil.rmtree(source)  # the checkpoint holds its own copy of the tokenizer
    assert _cli(["convert", "megazoo-to-hf", str(ckpt), "--out", str(back)]) == 0
    assert "with its tokenizer" in capsys.readouterr().out
    # the tokenizer travelled with the checkpoint: same ids, and its end-of-text is the model's eos
    exported = transformers.AutoTokenizer.from_pretrained(str(back))
    text = "def main():\n    return tokens"
    assert exported(text)["input_ids"] == tokenizer(text)["input_ids"]
    config = transformers.AutoConfig.from_pretrained(str(back))
    assert config.eos_token_id == tokenizer.eos_token_id
    ours = load_file(str(back / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model(family))
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, hf_logits(family))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "bert"}')
    assert _cli(["convert", "hf-to-megazoo", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "model_type 'bert' cannot be converted; valid: deepseek_v3, deepseek_v2, gpt2, llama, qwen2, mistral" in capsys.readouterr().err


def _pp2_logits(cfg, full):
    """The model split into two pipeline stages (blocks 0 | 1), the hidden states handed from one to the next."""
    from megazoo.models.hf.gpt2 import load_full_state_into
    from megazoo.models.transformer import GPT

    topo = Topology.solo()
    first = GPT(cfg, topo, layers=range(0, 1), with_head=False)
    last = GPT(cfg, topo, layers=range(1, 2), with_embedding=False)
    for stage in (first, last):
        load_full_state_into(stage, full)
        stage.eval()
    with torch.no_grad():
        return last(first(IDS))[..., :V]


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_stages_equal_transformers(family):
    cfg, full = converted(family)
    deviation = (_pp2_logits(cfg, full) - hf_logits(family)).abs().max().item()
    assert deviation < TOL, f"{family} pp=2: max |logit difference| {deviation:.2e}"


def _cp_logits(cfg, full, algorithm):
    from megazoo.parallel.context import positions

    topo = Topology.build(dp=1, tp=1, cp=2, cp_attention=algorithm)
    model = gpt_from_full_state(cfg, full, topo)
    mine = positions(IDS.shape[1] // 2, 2, topo.cp_rank)  # this rank's load-balanced chunks
    with torch.no_grad():
        return mine, model(IDS[:, mine])[..., :V]


# Mistral's window (6 < the 24 tokens) under cp: all-to-all gives the kernel whole sequences in token order, so the
# window's mask is the one-process mask; ring attention computes full causal tiles and refuses it (test below).
@pytest.mark.parametrize("family, algorithm", [("llama", "ring"), ("llama", "all_to_all"), ("qwen2", "ring"),
                                               ("qwen2", "all_to_all"), ("mistral", "all_to_all")])
def test_context_parallel_equals_transformers(family, algorithm):
    cfg, full = converted(family)
    ref = hf_logits(family)
    for mine, logits in run_distributed(lambda: _cp_logits(cfg, full, algorithm), 2):
        deviation = (logits - ref[:, mine]).abs().max().item()
        assert deviation < TOL, f"{family} cp=2 {algorithm}: max |logit difference| {deviation:.2e}"


def test_a_sliding_window_with_ring_attention_is_refused_before_any_process():
    from megazoo.recipes.catalog import find_recipe
    from megazoo.recipes.config import RecipeError, load_recipe
    from megazoo.recipes.resolve import resolve

    sets = ["model.sliding_window=8", "parallel.dp=1", "parallel.tp=1", "parallel.cp=2", "model.attn_dropout=0.0"]
    with pytest.raises(RecipeError, match='cp_attention = "ring" computes full causal attention, but '
                                          'model.sliding_window = 8; valid: cp_attention = "all_to_all"'):
        resolve(load_recipe(find_recipe("llama-demo"), [*sets, "parallel.cp_attention=ring"]))
    resolve(load_recipe(find_recipe("llama-demo"), [*sets, "parallel.cp_attention=all_to_all"]))
