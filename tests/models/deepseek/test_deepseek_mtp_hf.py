"""The multi-token prediction modules through the DeepSeek-V3 key map (models/deepseek/hf.py with mtp_hf.py).

Written as DeepSeek-V3's published checkpoint stores its one module (README_WEIGHTS.md; vLLM's and SGLang's MTP
loaders read these names): depth k as layer n_layer + k - 1 with enorm, hnorm, eh_proj, the decoder layer's own
names, shared_head.norm and the copies embed_tokens / shared_head.head, and config.json's num_nextn_predict_layers.
Read back bit for bit, through `megazoo convert` both ways with --verify too. A folder that transformers'
save_pretrained wrote declares num_nextn_predict_layers = 1 (its config's default) and holds no such layer: it reads
as mtp_depth 0 and converts as before. Copies that differ from the main embedding or head are refused.
`model.from_hf` of a folder holding the module fills every rank's slices of it (tp 2 x pp 2, ep 2) as the
one-process read does, its routing bias included."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from cli_helpers import megazoo
from deepseek_hf_helpers import IDS, V, hf_dir, hf_logits
from hf_helpers import safetensors_state

from megazoo.models.deepseek import hf as deepseek
from megazoo.models.hf.converter import write_hf_folder
from megazoo.models.hf.families import read_hf_config, read_hf_dir
from megazoo.models.hf.safetensors_files import HFWeights
from megazoo.models.layout import parameter_layout


def _mtp_model():
    """transformers' tiny "qlora" DeepseekV3 (MLA, q compression, sigmoid routing in groups, shared experts) with
    one random MTP module beside it: (config, full state with the routing biases)."""
    cfg, full = read_hf_dir(hf_dir("qlora"))
    cfg = cfg.replace(mtp_depth=1)
    gen = torch.Generator().manual_seed(5)
    for p in parameter_layout(cfg, vocab=cfg.vocab_size):
        if p.name.startswith("mtp."):
            full[p.name] = torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.name.endswith("norm.weight") else 0.0)
    full["mtp.layers.0.block.mlp.router.expert_bias"] = torch.randn(cfg.n_experts, generator=gen) * 0.1
    return cfg, full


def test_written_as_deepseeks_layer_n_layer_and_read_back(tmp_path):
    cfg, full = _mtp_model()
    write_hf_folder(tmp_path, deepseek.FAMILY, cfg, full.__getitem__, torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    weights = HFWeights(tmp_path)
    layer = "model.layers.3."  # n_layer 3: the module is the 4th layer
    extra = {n.removeprefix(layer) for n in weights.names() if n.startswith(layer)}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
                 "self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.o_proj.weight",
                 "post_attention_layernorm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                 "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight"):
        assert name in extra, name
    assert torch.equal(weights.read(layer + "eh_proj.weight"), full["mtp.layers.0.eh_proj.weight"])
    assert torch.equal(weights.read(layer + "shared_head.norm.weight"), full["mtp.layers.0.norm.weight"])
    assert torch.equal(weights.read(layer + "mlp.gate.e_score_correction_bias"),
                       full["mtp.layers.0.block.mlp.router.expert_bias"])
    assert torch.equal(weights.read(layer + "embed_tokens.weight"), full["wte.weight"])
    assert torch.equal(weights.read(layer + "shared_head.head.weight"), full["lm_head.weight"])
    back_cfg, back = read_hf_dir(tmp_path)
    assert back_cfg == cfg.replace(name=back_cfg.name) and back_cfg.mtp_depth == 1
    assert back.keys() == full.keys()
    for name, value in full.items():
        assert torch.equal(back[name], value), name
    # transformers ignores the extra layer and computes the main model
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    with torch.no_grad():
        assert (model(IDS).logits[..., :V] - hf_logits("qlora")).abs().max().item() < 1e-5


def test_convert_both_ways_keeps_the_module(tmp_path, capsys):
    cfg, full = _mtp_model()
    hf, ckpt, again = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "again"
    write_hf_folder(hf, deepseek.FAMILY, cfg, full.__getitem__, torch.float32)
    assert megazoo(["convert", "hf-to-megazoo", hf, "--out", ckpt, "--verify"]) == 0
    assert megazoo(["convert", "megazoo-to-hf", ckpt, "--out", again, "--verify"]) == 0
    out = capsys.readouterr().out
    assert out.count("logits (max abs difference)") == 2 and "FAIL" not in out and "left out" not in out, out
    first, second = safetensors_state(hf), safetensors_state(again)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert any(k.startswith("model.layers.3.") for k in second)


def test_a_folder_without_the_layer_reads_as_no_mtp():
    """transformers' save_pretrained: num_nextn_predict_layers 1 in config.json, no layer-3 tensor."""
    folder = hf_dir("qlora")
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(n.startswith("model.layers.3.") for n in HFWeights(folder).names())
    _, cfg, _ = read_hf_config(folder)
    assert cfg.mtp_depth == 0
    cfg, full = read_hf_dir(folder)
    assert not any(n.startswith("mtp.") for n in full) and "h.2.mlp.router.expert_bias" in full


def test_copies_that_differ_are_refused(tmp_path):
    cfg, full = _mtp_model()
    served = {"wte.weight": 0}

    def read(name):  # the export reads wte twice: the main embedding, then the MTP layer's copy (altered)
        if name != "wte.weight":
            return full[name]
        served[name] += 1
        return full[name] + (served[name] > 1)

    write_hf_folder(tmp_path, deepseek.FAMILY, cfg, read, torch.float32)
    with pytest.raises(ValueError, match="model.layers.3.embed_tokens.weight differs from model.embed_tokens.weight"):
        read_hf_dir(tmp_path)


def _rank_views(folder: str, parallel: dict):
    """`model.from_hf = folder` at `parallel`: this rank's parameter and routing-bias views after the load."""
    import copy

    from recipe_helpers import TINY

    from megazoo.parallel.topology import Topology
    from megazoo.recipes.config import Recipe, from_dict
    from megazoo.recipes.resolve import resolve
    from megazoo.recipes.training import checkpointing
    from megazoo.recipes.training.trainer import Trainer

    table = copy.deepcopy(TINY)
    table["model"] = {"preset": "deepseek-tiny", "from_hf": folder, "dropout": 0.0, "attn_dropout": 0.0}
    table["parallel"].update(parallel)
    table["train"].update(micro_batch=2, seq_len=16)
    res = resolve(from_dict(Recipe, table))
    assert res.model.mtp_depth == 1  # the depth the folder holds
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    checkpointing.restore(trainer, report=lambda _: None)
    return [(v.name, v.spec, v.start, v.stop, v.tensor.detach().clone()) for v in checkpointing.state_views(trainer)
            if v.kind == "param"]


@pytest.mark.parametrize("parallel", [{"tp": 2, "pp": 2, "schedule": "1f1b"}, {"dp": 2, "ep": 2}])
def test_from_hf_fills_each_ranks_mtp_slices(tmp_path, parallel):
    """`model.from_hf` of a folder holding layer n_layer: every rank's slices (tp 2 x pp 2: the module and the head
    on the last stage, heads split over tp; ep 2: the module's experts split) equal the one-process read of the
    folder, the module's routing bias included."""
    from harness import run_distributed

    from megazoo.parallel.tensor import shard_of

    cfg, full = _mtp_model()
    write_hf_folder(tmp_path, deepseek.FAMILY, cfg, full.__getitem__, torch.float32)
    _, one = read_hf_dir(tmp_path)
    world = parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("dp", 1)
    seen = set()
    for views in run_distributed(_rank_views, world, str(tmp_path), parallel):
        for name, spec, start, stop, got in views:
            want = one[name].to(got.dtype)
            if want.shape[0] < spec.global_shape[0]:  # the padded vocabulary's zero rows
                want = torch.cat([want, want.new_zeros(spec.global_shape[0] - want.shape[0], *want.shape[1:])])
            assert torch.equal(got, shard_of(want, spec).reshape(-1)[start:stop]), (name, start, stop)
            seen.add(name)
    assert seen == set(one)  # every tensor reached some rank, the module's 30-odd among them
    assert "mtp.layers.0.block.mlp.router.expert_bias" in seen and "mtp.layers.0.eh_proj.weight" in seen
