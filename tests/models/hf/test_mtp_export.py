"""Multi-token prediction modules on HF export (models/hf/family.py's exported_config, models/deepseek/mtp_hf.py).

Families whose HF format has no place for them (Llama, Qwen, Mixtral, GPT-2) drop them: the folder holds the main
model only and transformers' logits equal ours (with the MTP modules) to the export check's tolerance. Where the
format keeps them (DeepSeek-V3: layer n_layer + k - 1; the DeepSeek key map sets Family.mtp and extends its
entries with mtp_entries), they are written under DeepSeek's names with the shared embedding / head copies and
read back bit for bit; copies that differ from the main tensors are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megazoo.models.config import ModelConfig
from megazoo.models.hf import llama
from megazoo.models.hf.convert_verify import fixed_sample, hf_dir_logits_fn, megazoo_logits_fn
from megazoo.models.hf.converter import megazoo_tensors, write_hf_folder
from megazoo.models.deepseek.mtp_hf import check_shared_copies, mtp_entries
from megazoo.models.hf.safetensors_files import HFWeights
from megazoo.models.layout import parameter_layout

CFG = ModelConfig(name="tiny-mtp", n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, n_positions=64,
                  vocab_size=300, norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False,
                  qkv_bias=False, proj_bias=False, mlp_bias=False, dropout=0.0, attn_dropout=0.0, mtp_depth=2)


def _state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {p.name: torch.randn(p.shape) * 0.1 + (1.0 if p.name.endswith("norm.weight") else 0.0)
            for p in parameter_layout(cfg, vocab=cfg.vocab_size)}


def test_llama_export_drops_the_mtp_modules(tmp_path):
    state = _state(CFG)
    assert any(name.startswith("mtp.") for name in state)
    write_hf_folder(tmp_path, llama.FAMILY, CFG, state.__getitem__, torch.float32)
    names = set(HFWeights(tmp_path).names())
    assert not any(".layers.2." in n or ".layers.3." in n or "hnorm" in n for n in names)
    assert names == {n for e in llama.entries(CFG.replace(mtp_depth=0)) for n in e.hf}
    ids = fixed_sample(CFG)  # ours (the model with its MTP modules) against transformers' LlamaForCausalLM
    ours, theirs = megazoo_logits_fn(CFG, state, torch.float32)(ids), hf_dir_logits_fn(tmp_path)(ids)
    assert ours.shape == theirs.shape and (ours - theirs).abs().max() < 1e-5
    llama.export_hf_dir(state, CFG, tmp_path / "again")  # the Llama writer's own name check leaves them out too


def _keeping(copies: bool):
    """A family that keeps the modules as DeepSeek-V3's format does (Llama's block names stand in for its)."""
    return dataclasses.replace(
        llama.FAMILY, mtp=True, ignored=llama.FAMILY.ignored + ("embed_tokens.weight", "shared_head.head.weight"),
        entries=lambda cfg: llama.entries(cfg.replace(mtp_depth=0)) + mtp_entries(cfg, llama.entries, copies=copies))


def test_deepseek_style_export_keeps_them_as_layer_n_layer(tmp_path):
    state = _state(CFG)
    write_hf_folder(tmp_path, _keeping(copies=True), CFG, state.__getitem__, torch.float32)
    weights = HFWeights(tmp_path)
    assert torch.equal(weights.read("model.layers.2.hnorm.weight"), state["mtp.layers.0.hnorm.weight"])
    assert torch.equal(weights.read("model.layers.3.eh_proj.weight"), state["mtp.layers.1.eh_proj.weight"])
    assert torch.equal(weights.read("model.layers.2.shared_head.norm.weight"), state["mtp.layers.0.norm.weight"])
    assert torch.equal(weights.read("model.layers.3.self_attn.q_proj.weight"),
                       state["mtp.layers.1.block.attn.c_q.weight"])
    assert torch.equal(weights.read("model.layers.2.embed_tokens.weight"), state["wte.weight"])
    assert torch.equal(weights.read("model.layers.3.shared_head.head.weight"), state["lm_head.weight"])
    back = dict(megazoo_tensors(weights, _keeping(copies=False), CFG))
    assert back.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(back[name], value), name
    check_shared_copies(weights.read, CFG, "model.embed_tokens.weight", "lm_head.weight")


def test_differing_shared_copies_are_refused():
    read = {"model.embed_tokens.weight": torch.zeros(2), "lm_head.weight": torch.ones(2),
            "model.layers.2.embed_tokens.weight": torch.zeros(2), "model.layers.2.shared_head.head.weight": torch.ones(2),
            "model.layers.3.embed_tokens.weight": torch.zeros(2),
            "model.layers.3.shared_head.head.weight": torch.zeros(2)}.__getitem__
    with pytest.raises(ValueError, match="model.layers.3.shared_head.head.weight differs from lm_head.weight"):
        check_shared_copies(read, CFG, "model.embed_tokens.weight", "lm_head.weight")


def test_adding_mtp_to_a_folder_without_it_is_refused(tmp_path):
    """The dropped modules do not come back: a folder without them reads as mtp_depth 0, and `model.from_hf` with
    mtp_depth set is refused before any process starts, as every architecture override is."""
    import copy

    from recipe_helpers import TINY

    from megazoo.recipes.config import Recipe, RecipeError, from_dict
    from megazoo.recipes.resolve import resolve

    write_hf_folder(tmp_path, llama.FAMILY, CFG, _state(CFG).__getitem__, torch.float32)
    table = copy.deepcopy(TINY)
    table["model"] = {"from_hf": str(tmp_path), "mtp_depth": 2, "dropout": 0.0, "attn_dropout": 0.0}
    with pytest.raises(RecipeError, match="model.mtp_depth = 2 here, 0 in the checkpoint"):
        resolve(from_dict(Recipe, table))


def test_convert_cli_says_the_modules_are_left_out(tmp_path, capsys):
    """A trained MTP model's checkpoint through `megazoo convert megazoo-to-hf` (the logits: the test above)."""
    from recipe_helpers import tiny_resolved

    from megazoo.parallel.topology import Topology
    from megazoo.recipes.cli import main as megazoo
    from megazoo.recipes.training.trainer import Trainer

    res = tiny_resolved(model={"preset": "llama-tiny", "n_layer": 2, "d_model": 32, "n_head": 4, "n_kv_head": 2,
                               "d_ff": 48, "n_positions": 64, "vocab_size": 300, "dropout": 0.0, "attn_dropout": 0.0,
                               "mtp_depth": 1}, train={"steps": 1, "seq_len": 16, "eval_batches": 1},
                        run={"dir": str(tmp_path / "run")}, checkpoint={"at_end": True})
    Trainer(res, Topology.solo()).fit()
    capsys.readouterr()
    assert megazoo(["convert", "megazoo-to-hf", str(tmp_path / "run" / "checkpoints"), "--out", str(tmp_path / "hf"),
                    "--tokenizer", "none"]) == 0
    out = capsys.readouterr().out
    assert "the 1 multi-token prediction module(s) are left out: HF llama has no place for them" in out
    assert not any("layers.2" in n for n in HFWeights(tmp_path / "hf").names())
