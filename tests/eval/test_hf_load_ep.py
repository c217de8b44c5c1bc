"""`eval --hf DIR --ep N` / `generate --hf DIR --ep N` load memory-split (models/loading.load_gpt_from_hf, the
`model.from_hf` reader): on a tiny Mixtral HF folder stored in fp64, at ep 2 (and tp 2 x ep 2) each rank's
parameters equal the single-process load's slices, its logits equal ep 1's to 1e-12, and it reads from the folder
only its own experts' tensors (every read counted): at tp 1 exactly the folder less the other rank's experts; eval's
--hf path (eval/cli._logits_fn) reads the same bytes."""

from __future__ import annotations

import argparse

import pytest
import torch
from harness import run_distributed
from transformers import MixtralConfig, MixtralForCausalLM

from megazoo.eval.scoring import gpt_logits_fn
from megazoo.models.hf.families import read_hf_dir
from megazoo.models.hf.gpt2 import gpt_from_full_state
from megazoo.models.hf.safetensors_files import HFWeights
from megazoo.models.loading import load_gpt_from_hf
from megazoo.parallel.tensor import named_shards, shard_of
from megazoo.parallel.topology import Topology

IDS = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_ep") / "mixtral"
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32, initializer_range=0.1, tie_word_embeddings=False)
    MixtralForCausalLM(cfg).to(torch.float64).save_pretrained(str(path), max_shard_size="40KB")
    return path


def _counting() -> tuple[list[str], list[int]]:
    """Patch HFWeights (in this forked rank) to record every tensor name read and every byte copied out of the
    files, whichever instance reads them; returns the two lists."""
    names: list[str] = []
    sizes: list[int] = []
    read, block, count = HFWeights.read, HFWeights.read_block, HFWeights._count
    HFWeights.read = lambda self, name: names.append(name) or read(self, name)
    HFWeights.read_block = lambda self, name, *a, **k: names.append(name) or block(self, name, *a, **k)
    HFWeights._count = lambda self, t: sizes.append(t.numel() * t.element_size()) or count(self, t)
    return names, sizes


def _expert(name: str) -> int | None:
    return int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_load_at_ep2_reads_only_this_ranks_experts_and_equals_ep1(folder, tp):
    whole = HFWeights(folder)
    total = sum(whole.nbytes(n) for n in whole.names())
    per_expert = {e: sum(whole.nbytes(n) for n in whole.names() if _expert(n) == e) for e in range(4)}
    solo = gpt_from_full_state(*read_hf_dir(folder), Topology.solo(), torch.float64)
    reference = gpt_logits_fn(solo)(IDS)
    full = {name: param.detach() for name, param, _ in named_shards(solo)}

    def rank():
        topo = Topology.build(dp=2, tp=tp, ep=2)
        (names, sizes), weights = _counting(), HFWeights(folder)
        model = load_gpt_from_hf(folder, topo, torch.float64, weights=weights)
        mine = range(2 * topo.ep_rank, 2 * topo.ep_rank + 2)
        for name, param, spec in named_shards(model):
            want = full[name]  # tp 2 pads the vocabulary further: zero rows
            want = torch.cat([want, want.new_zeros(spec.global_shape[0] - want.shape[0], *want.shape[1:])])
            assert torch.equal(param.detach(), shard_of(want, spec)), name
        assert {_expert(n) for n in names} - {None} == set(mine)  # the other rank's experts: never read
        read = weights.bytes_read
        assert sum(sizes) == read
        names.clear(), sizes.clear()
        from megazoo.eval.cli import _logits_fn  # eval --hf's own load (fp32 model), counted the same way

        _logits_fn(argparse.Namespace(backend="megatron", hf=str(folder)), None, topo)
        return gpt_logits_fn(model)(IDS), read, {_expert(n) for n in names} - {None}, set(mine), sum(sizes)

    for logits, read, eval_experts, mine, eval_read in run_distributed(rank, 2 * tp):
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-12)
        others = sum(per_expert[e] for e in range(4) if e not in mine)
        assert 0 < others and read <= total - others  # every rank reads less than the folder
        if tp == 1:
            assert read == total - others  # each tensor once, all but the other rank's experts
        assert eval_experts == mine and eval_read == read  # eval --hf: the same reader, the same bytes


def test_a_tied_head_stored_unequal_is_refused(tmp_path):
    """A folder whose config ties the head but that stores a different lm_head.weight is refused, as the whole
    state load refused it (converter.check_copies); stored equal, it loads."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                 tie_word_embeddings=True)).save_pretrained(str(tmp_path))
    state = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in state
    for head, ok in ((state["model.embed_tokens.weight"].clone(), True), (torch.zeros(96, 32), False)):
        save_file({**state, "lm_head.weight": head}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        if ok:
            load_gpt_from_hf(tmp_path, Topology.solo())
        else:
            with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
                load_gpt_from_hf(tmp_path, Topology.solo())
