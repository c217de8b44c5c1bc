"""Every preset builds on the meta device (shapes only) and has exactly the parameter count of its formula.

Known counts: GPT-2 117M is Hugging Face's 124,439,808; GPT-2 1.5B is 1,557,611,200; Turing-NLG is 17.18 B.
The tp = 4 shard counts use 4 real gloo ranks (real tp groups, meta tensors), so no process-group stand-in is needed.
"""

import pytest
from harness import run_distributed

from megazoo.models.config import ModelConfig
from megazoo.models.presets import get_preset, presets
from megazoo.models.transformer import GPT
from megazoo.models.weights import count_parameters, named_shards
from megazoo.parallel.topology import Topology

PRESETS = presets()
# The GPT-2 block's presets (the Llama-style families' counts: tests/models/test_llama_presets.py).
GPT2_BLOCK = {name: cfg for name, cfg in PRESETS.items() if cfg.positions == "learned"}
KNOWN_COUNTS = {"gpt2-117m": 124_439_808, "gpt2-1.5b": 1_557_611_200, "tnlg-17b": 17_176_845_728,
                # 12 L h^2 + 13 L h + (V + positions) h + 2 h at L = 128, h = 25600, V = 50257, 2048 positions
                "gpt-1t": 1_008_014_617_600}


def replicated_count(cfg: ModelConfig) -> int:
    """Parameters every tp rank holds whole: positions, the 4 LayerNorm vectors and 2 row-parallel biases per
    block, the final LayerNorm."""
    d = cfg.d_model
    return cfg.n_positions * d + cfg.n_layer * 6 * d + 2 * d


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_on_meta_with_the_formula_count(name):
    cfg = PRESETS[name]
    model = GPT(cfg, Topology.solo(), device="meta")
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert count_parameters(model, cfg.vocab_size) == cfg.num_parameters()
    assert count_parameters(model) == cfg.num_parameters(cfg.padded_vocab(1))
    assert len(model.h) == cfg.n_layer and model.wte.weight.shape == (cfg.padded_vocab(1), cfg.d_model)


@pytest.mark.parametrize("name", sorted(KNOWN_COUNTS))
def test_known_parameter_counts(name):
    assert PRESETS[name].num_parameters() == KNOWN_COUNTS[name]


def test_turing_nlg_is_17_18_billion():
    assert round(get_preset("tnlg-17b").num_parameters() / 1e9, 2) == 17.18


def test_gpt_1t_is_the_closed_form_trillion():
    cfg = get_preset("gpt-1t")
    L, h = cfg.n_layer, cfg.d_model
    assert (L, cfg.n_head, h, cfg.n_positions) == (128, 160, 25600, 2048)  # Narayanan et al. 2021, table 1
    assert cfg.num_parameters() == 12 * L * h * h + 13 * L * h + (cfg.vocab_size + cfg.n_positions) * h + 2 * h
    assert round(cfg.num_parameters() / 1e12, 3) == 1.008


TP = 4


def _shard_counts(topo):
    out = {}
    for name, cfg in GPT2_BLOCK.items():
        if cfg.n_head % TP:
            with pytest.raises(ValueError, match=f"n_head = {cfg.n_head}"):
                GPT(cfg, topo, device="meta")
            continue
        model = GPT(cfg, topo, device="meta")
        assert all(p.is_meta for p in model.parameters())
        shapes = {n: (tuple(p.shape), s.local_shape, s.global_shape) for n, p, s in named_shards(model)}
        out[name] = (count_parameters(model), count_parameters(model, cfg.vocab_size), shapes)
    return out


def test_tp4_shard_counts_on_meta():
    per_rank = run_distributed(lambda: _shard_counts(Topology.build(dp=1, tp=TP)), TP)
    divisible = [name for name, cfg in GPT2_BLOCK.items() if cfg.n_head % TP == 0]
    assert "gpt2-1.5b" not in divisible and "tnlg-17b" in divisible and "gpt3-175b" in divisible
    for name in divisible:
        cfg = PRESETS[name]
        replicated = replicated_count(cfg)
        padded = cfg.num_parameters(cfg.padded_vocab(TP))
        sharded = padded - replicated
        assert sharded % TP == 0
        solo = {n: tuple(p.shape) for n, p, _ in named_shards(GPT(cfg, Topology.solo(), device="meta"))}
        unpadded_total = 0
        for rank, counts in enumerate(per_rank):
            total, unpadded, shapes = counts[name]
            assert total == sharded // TP + replicated, (name, rank)
            unpadded_total += unpadded
            assert shapes.keys() == solo.keys()
            for param, (local, spec_local, spec_global) in shapes.items():
                assert local == spec_local, (name, param)
                if param != "wte.weight":  # the embedding is padded to a multiple of 128 * tp
                    assert spec_global == solo[param], (name, param)
            assert shapes["wte.weight"][2] == (cfg.padded_vocab(TP), cfg.d_model)
        # Summed over ranks: the model once, plus the replicated parameters on the other tp - 1 ranks.
        assert unpadded_total == cfg.num_parameters() + (TP - 1) * replicated, name


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(ValueError) as err:
        get_preset("gpt2-huge")
    message = str(err.value)
    assert "'gpt2-huge'" in message
    for name in PRESETS:
        assert name in message


def test_d_model_not_divisible_by_heads_is_rejected():
    with pytest.raises(ValueError, match="d_model = 100 is not divisible by model.n_head = 3"):
        ModelConfig("bad", n_layer=2, n_head=3, d_model=100)
    with pytest.raises(ValueError, match="d_model"):
        get_preset("gpt2-tiny").replace(d_model=130)


def test_meta_model_cannot_be_initialised():
    from megazoo.models.weights import init_weights

    with pytest.raises(ValueError, match="meta"):
        init_weights(GPT(get_preset("gpt2-tiny"), Topology.solo(), device="meta"), 0)


def test_overriding_d_model_keeps_the_mlp_at_four_times():
    from megazoo.models.presets import get_preset
    cfg = get_preset("gpt2-tiny").replace(d_model=64)
    assert cfg.d_ff == 256
    assert get_preset("gpt2-tiny").replace(d_model=64, d_ff=100).d_ff == 100
