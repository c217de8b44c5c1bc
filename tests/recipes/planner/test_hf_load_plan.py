"""`megazoo plan` states the host memory a rank needs while `model.from_hf` loads it (recipes/planner/hf_load.py):
its largest single read R equals, byte for byte, the largest read the safetensors reader counts over every tp rank
and parameter (GPT-2 and Llama, fp32 and bf16 files, tp 1 / 2 / 4), fill_views_from_hf's own count agrees, ZeRO-3
ranges read no more, and `megazoo plan --recipe` prints the figure for a recipe with model.from_hf."""

from __future__ import annotations

import pytest
import torch
import transformers

from megazoo.models.hf.converter import fill_views_from_hf, read_local
from megazoo.models.hf.families import read_hf_config
from megazoo.models.hf.safetensors_files import HFWeights
from megazoo.models.layout import parameter_layout
from megazoo.parallel.checkpoint.views import StateView
from megazoo.parallel.tensor import ShardSpec
from megazoo.recipes import cli
from megazoo.recipes.planner.hf_load import file_dtype_bytes, load_memory

MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, n_positions=16, vocab_size=100)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=[("gpt2", torch.float32), ("llama", torch.float32),
                                        ("llama", torch.bfloat16)], ids=["gpt2-fp32", "llama-fp32", "llama-bf16"])
def folder(request, tmp_path_factory):
    name, dtype = request.param
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / name
    MODELS[name]().to(dtype).save_pretrained(str(path), max_shard_size="20KB")
    return path


def _spec(p, tp, rank):
    return ShardSpec(p.shape, p.tp_dim, p.sections, rank, tp) if p.tp_dim is not None else ShardSpec(p.shape)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_planned_largest_read_is_the_readers(folder, tp):
    family, cfg, _ = read_hf_config(folder)
    entries = {e.ours: e for e in family.entries(cfg)}
    plan = load_memory(cfg, tp, file_dtype_bytes(str(folder)), 4)
    largest, name, zero3 = 0, "", 0
    for p in parameter_layout(cfg, tp):
        for rank in range(tp):
            spec = _spec(p, tp, rank)
            n = spec.local_shape[0] * (spec.local_shape[1] if len(spec.local_shape) > 1 else 1)
            weights = HFWeights(folder)
            read_local(weights, entries[p.name], spec, 0, n)  # a whole tp-local view (ZeRO 0-2)
            largest, name = max((largest, name), (weights.bytes_read, p.name))
            for start, stop in [(n // 3 + 1, n), (n // 5 + 1, n // 2 + 3)]:  # ZeRO-3 pieces
                weights = HFWeights(folder)
                read_local(weights, entries[p.name], spec, start, stop)
                zero3 = max(zero3, weights.bytes_read)
    assert (plan.largest_read, plan.name) == (largest, name)
    assert zero3 <= plan.largest_read
    assert plan.peak == plan.largest_read + max(plan.largest_read, plan.elements * 4)


def test_fill_views_counts_the_same_largest_read(folder):
    family, cfg, _ = read_hf_config(folder)
    tp = 2
    views = []
    for p in parameter_layout(cfg, tp):
        spec = _spec(p, tp, 0)
        n = torch.Size(spec.local_shape).numel()
        views += [StateView(p.name, spec, kind, 0, n, torch.zeros(n, dtype=dtype))
                  for kind, dtype in (("param", torch.bfloat16), ("master", torch.float32))]
    weights = HFWeights(folder)
    fill_views_from_hf(weights, family, cfg, views)
    assert weights.largest_read == load_memory(cfg, tp, file_dtype_bytes(str(folder)), 4).largest_read


def test_plan_states_the_loading_memory(tmp_path, capsys):
    folder = tmp_path / "llama"
    MODELS["llama"]().to(torch.bfloat16).save_pretrained(str(folder))
    recipe = tmp_path / "ft.toml"
    recipe.write_text(f'[model]\npreset = "llama-tiny"\nfrom_hf = "{folder}"\n[parallel]\ntp = 2\n'
                      '[train]\nprecision = "bf16"\nseq_len = 16\n[data]\nsource = "synthetic"\n')
    cli.main(["plan", "--recipe", str(recipe), "--gpu-memory", "80"])
    _, cfg, _ = read_hf_config(folder)
    plan = load_memory(cfg, 2, file_dtype_bytes(str(folder)), 4)
    out = capsys.readouterr().out
    assert f"loading model.from_hf: host memory per rank {plan.peak / 1e9:.2f} GB" in out
    assert f"largest single read {plan.largest_read / 1e9:.2f} GB: {plan.name} at tp 2" in out
