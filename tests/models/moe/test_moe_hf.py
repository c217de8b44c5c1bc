"""HF MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM / Qwen3ForCausalLM <-> megazoo: logits equal
transformers' own from tiny random configs (no download) to 1e-5 in fp32 at tp = 1 and tp = 2 (plain and with
sequence parallelism, on gloo), the load-balancing aux loss equals transformers' `aux_loss`, greedy generation
equals transformers' token for token, and the export (the registry's family and the one streaming writer) loads
into transformers with the same logits and the same tensors as transformers' own save_pretrained. Models are read
from the folder transformers' save_pretrained writes, as the converter reads them (families.read_hf_dir).

The configs exercise what each family adds: Mixtral's renormalised top-2 of 4 experts in every layer; Qwen3-MoE's
q/k norms, heads wider than d_model / n_head, un-renormalised top-2 and a dense layer in the middle
(mlp_only_layers); Qwen2-MoE's q/k/v bias, gated shared expert and decoder_sparse_step 2; Qwen3's q/k norms and
head_dim with a tied head.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from harness import run_distributed
from hf_helpers import FAMILY_VOCAB as V, MOE_FAMILIES as FAMILIES, tiny_family_model

from megazoo.models.generation.generate import decode
from megazoo.models.hf.gpt2 import gpt_from_full_state
from safetensors import safe_open

from megazoo.models.hf.converter import write_hf_folder
from megazoo.models.hf.families import family_of_config, read_hf_dir
from megazoo.models.hf.moe_families import FAMILY, config_from_hf, config_to_hf, hf_family
from megazoo.models.moe import load_balancing_loss
from megazoo.parallel.tensor import gather_from_tp_region
from megazoo.parallel.topology import Topology

TOL = 1e-5
IDS = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(3))


@functools.lru_cache(maxsize=None)
def hf_model(family: str):
    return tiny_family_model(family, noise=0.3)


@functools.lru_cache(maxsize=None)
def hf_out(family: str):
    with torch.no_grad():
        return hf_model(family)(IDS, output_router_logits=family != "qwen3")


@functools.lru_cache(maxsize=None)
def hf_dir(family: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"moe-hf-{family}-")) / f"tiny-{family}"
    hf_model(family).save_pretrained(str(path))
    return path


def converted(family: str):
    return read_hf_dir(hf_dir(family))


def _files(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _ours(topo: Topology, cfg, full):
    model = gpt_from_full_state(cfg, full, topo)
    with torch.no_grad():
        logits = gather_from_tp_region(model(IDS), topo.tp_group)[..., :V]
        aux = load_balancing_loss(model.moe_stats(), cfg.n_experts) if cfg.n_experts else None
    return logits, aux


@pytest.mark.parametrize("family", FAMILIES)
def test_config_maps_each_family(family):
    cfg, _ = converted(family)
    assert hf_family(cfg) == family and family_of_config(cfg) is FAMILY
    hf = hf_model(family)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert config_from_hf(config_to_hf(cfg), name=cfg.name) == cfg
    moe_layers = [i for i in range(cfg.n_layer) if cfg.moe_layer(i)]
    expected = {"mixtral": [0, 1], "qwen3_moe": [0, 2], "qwen2_moe": [1, 3], "qwen3": []}[family]
    assert moe_layers == expected
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")] == expected


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2-sp"])
def test_logits_and_aux_loss_equal_transformers(family, layout):
    cfg, full = converted(family)
    ref = hf_out(family)
    if layout == "tp1":
        outs = [_ours(Topology.solo(), cfg, full)]
    else:
        sp = layout == "tp2-sp"
        outs = run_distributed(lambda: _ours(Topology.build(dp=1, tp=2, sequence_parallel=sp), cfg, full), 2)
    for logits, aux in outs:
        deviation = (logits - ref.logits).abs().max().item()
        assert deviation < TOL, f"{family} {layout}: max |logit difference| {deviation:.2e}"
        if cfg.n_experts:
            assert abs(aux.item() - ref.aux_loss.item()) < 1e-6, (aux.item(), ref.aux_loss.item())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers(family):
    cfg, full = converted(family)
    model = gpt_from_full_state(cfg, full, Topology.solo())
    prompt = IDS[0, :6]
    theirs = hf_model(family).generate(prompt[None], max_new_tokens=10, do_sample=False, pad_token_id=0,
                                       eos_token_id=None, min_new_tokens=10)
    ours = decode(model, prompt.tolist(), 10, temperature=0.0)
    assert ours == theirs[0].tolist() and len(ours) == 16


@pytest.mark.parametrize("family", FAMILIES)
def test_export_equals_save_pretrained_and_loads_into_transformers(family, tmp_path):
    cfg, full = converted(family)
    write_hf_folder(tmp_path / "hf", FAMILY, cfg, full.__getitem__, torch.float32)
    ours, theirs = _files(tmp_path / "hf"), _files(hf_dir(family))
    theirs.pop("lm_head.weight", None) if cfg.tie_embeddings else None
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    if cfg.n_experts:  # the files name every expert: expert 3's down projection of layer 0, say
        assert any(".experts.3." in name for name in ours)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    with torch.no_grad():
        logits = loaded.eval()(IDS).logits
    assert (logits - hf_out(family).logits).abs().max().item() < TOL
