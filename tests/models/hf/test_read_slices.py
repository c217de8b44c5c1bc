"""A rank's own slices straight from HF safetensors (issue 39, `model.from_hf`): for every parameter of a GPT-2
(transposed Conv1D, fused QKV by sections) and a Llama (GQA, fused [k; v] and [gate; up], untied head) model, at
tp 1, 2 and 4, every tp rank and ZeRO-3-like flat ranges cut anywhere, `read_local` equals the converted full
tensor cut by shard_of (padded vocabulary rows zero), and reads only about its own bytes."""

from __future__ import annotations

import pytest
import torch
import transformers

from megazoo.models.hf.converter import megazoo_tensors, read_local
from megazoo.models.hf.families import read_hf_config
from megazoo.models.hf.safetensors_files import HFWeights
from megazoo.models.layout import parameter_layout
from megazoo.parallel.tensor import ShardSpec, shard_of

MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, n_positions=16, vocab_size=100)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def folder(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / request.param
    MODELS[request.param]().save_pretrained(str(path), max_shard_size="20KB")
    return path


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_local_slices_equal_the_converted_shards(folder, tp):
    family, cfg, _ = read_hf_config(folder)
    full = dict(megazoo_tensors(HFWeights(folder), family, cfg))
    entries = {e.ours: e for e in family.entries(cfg)}
    for p in parameter_layout(cfg, tp):
        tensor = full[p.name]
        if tensor.shape[0] < p.shape[0]:  # the padded vocabulary
            tensor = torch.cat([tensor, tensor.new_zeros(p.shape[0] - tensor.shape[0], *tensor.shape[1:])])
        for rank in range(tp):
            spec = ShardSpec(p.shape, p.tp_dim, p.sections, rank, tp) if p.tp_dim is not None else ShardSpec(p.shape)
            want = shard_of(tensor, spec).reshape(-1)
            n = want.numel()
            for start, stop in [(0, n), (n // 3 + 1, n), (0, 2 * n // 3 + 1), (n // 5 + 1, n // 2 + 3)]:
                weights = HFWeights(folder)
                got = read_local(weights, entries[p.name], spec, start, stop)
                assert torch.equal(got, want[start:stop]), (p.name, tp, rank, start, stop)
                row = max(1, n // spec.local_shape[0]) if len(spec.local_shape) > 1 else 1
                assert weights.bytes_read <= (stop - start + 2 * row) * 4, (p.name, weights.bytes_read)


def test_moe_local_slices_equal_the_converted_shards(tmp_path):
    """The MoE key map (stacked experts: Entry.stacked) cut for every tp rank and flat range; an expert tensor
    split over ep 2 or 4 (the layout of models/moe/block.py) read by each ep rank from its own experts' HF
    tensors only: about its own bytes, never another rank's expert."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=16, num_hidden_layers=1, num_experts=4,
                                         num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=16)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path), max_shard_size="20KB")
    family, cfg, _ = read_hf_config(tmp_path)
    full = dict(megazoo_tensors(HFWeights(tmp_path), family, cfg))
    entries = {e.ours: e for e in family.entries(cfg)}
    assert entries["h.0.mlp.experts.c_fc.weight"].stacked == 2  # [gate_e; up_e] per expert e
    for tp in (1, 2):
        for p in parameter_layout(cfg, tp):
            tensor = full[p.name]
            if tensor.shape[0] < p.shape[0]:
                tensor = torch.cat([tensor, tensor.new_zeros(p.shape[0] - tensor.shape[0], *tensor.shape[1:])])
            for rank in range(tp):
                spec = ShardSpec(p.shape, p.tp_dim, p.sections, rank, tp) if p.tp_dim is not None else ShardSpec(p.shape)
                want = shard_of(tensor, spec).reshape(-1)
                n = want.numel()
                for start, stop in [(0, n), (n // 3 + 1, n // 2 + 3)]:
                    got = read_local(HFWeights(tmp_path), entries[p.name], spec, start, stop)
                    assert torch.equal(got, want[start:stop]), (p.name, tp, rank, start, stop)
    for name in ("h.0.mlp.experts.c_fc.weight", "h.0.mlp.experts.c_proj.weight"):
        for ep in (2, 4):
            for rank in range(ep):
                spec = ShardSpec(tuple(full[name].shape), 0, 1, rank, ep)
                want = shard_of(full[name], spec).reshape(-1)
                n, row = want.numel(), want.numel() // spec.local_shape[0]
                for start, stop in [(0, n), (row // 2 + 1, n - 3)]:
                    weights, names = HFWeights(tmp_path), []
                    weights.read = lambda name, read=weights.read, names=names: names.append(name) or read(name)
                    got = read_local(weights, entries[name], spec, start, stop)
                    assert torch.equal(got, want[start:stop]), (name, ep, rank, start, stop)
                    mine = {f".experts.{e}." for e in range(rank * 4 // ep, (rank + 1) * 4 // ep)}
                    assert names and all(any(m in n for m in mine) for n in names), (name, ep, rank, names)
                    assert weights.bytes_read == n * 4, (name, ep, rank, weights.bytes_read)
