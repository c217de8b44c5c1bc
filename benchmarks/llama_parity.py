"""The Llama-style family's parity table: HF families x layouts x the largest deviation, printed as markdown.

    python -m benchmarks.llama_parity

- fp32, against transformers' own LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM built from tiny
  configs with random weights (no download): max |logit difference| at tp 1, 2 (key/value heads split) and
  4 (replicated), in two pipeline stages, under context parallelism cp 2 (ring, all-to-all), and the
  HF -> megazoo -> HF round trip (max |tensor difference|: 0 means identical);
- fp64, megazoo against itself in one process: max |difference| of logits and of every gradient at tp 2 and 4.
The tests (tests/models/test_llama_hf.py, tests/models/test_llama_parallel.py) hold these below 1e-5 and 1e-10.
"""

from __future__ import annotations

import torch
import transformers

from megazoo.models.hf.gpt2 import gpt_from_full_state
from megazoo.models.hf.llama import config_from_hf, hf_to_megazoo_state, megazoo_to_hf_state
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.tensor import gather_from_tp_region, gather_full, named_shards
from megazoo.parallel.topology import Topology
from megazoo.workers.local import run_distributed

V = 300
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
FAMILIES = {
    "llama (llama3 rope, untied)": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16)),
    "qwen2 (qkv bias, tied)": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "mistral (window 6 < 24 tokens)": lambda: transformers.MistralConfig(**COMMON, sliding_window=6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}
IDS = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(3))


def _hf(make):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make(), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _logits(tp, cfg, full):
    topo = Topology.solo() if tp == 1 else Topology.build(dp=1, tp=tp)
    with torch.no_grad():
        return gather_from_tp_region(gpt_from_full_state(cfg, full, topo)(IDS), topo.tp_group)[..., :V]


def _pp2(cfg, full):
    from megazoo.models.hf.gpt2 import load_full_state_into

    first = GPT(cfg, Topology.solo(), layers=range(0, 1), with_head=False)
    last = GPT(cfg, Topology.solo(), layers=range(1, 2), with_embedding=False)
    for stage in (first, last):
        load_full_state_into(stage, full)
        stage.eval()
    with torch.no_grad():
        return last(first(IDS))[..., :V]


def _cp2(cfg, full, algorithm):
    from megazoo.parallel.context import positions

    topo = Topology.build(dp=1, tp=1, cp=2, cp_attention=algorithm)
    mine = positions(IDS.shape[1] // 2, 2, topo.cp_rank)
    with torch.no_grad():
        return mine, gpt_from_full_state(cfg, full, topo)(IDS[:, mine])[..., :V]


def hf_rows() -> list[list[str]]:
    rows = []
    for family, make in FAMILIES.items():
        model = _hf(make)
        cfg = config_from_hf(model.config, name="tiny")
        full = hf_to_megazoo_state(model.state_dict(), cfg)
        with torch.no_grad():
            ref = model(IDS).logits
        for tp in (1, 2, 4):
            outs = [_logits(1, cfg, full)] if tp == 1 else run_distributed(lambda t=tp: _logits(t, cfg, full), tp)
            dev = max((o - ref).abs().max().item() for o in outs)
            kv = "" if tp == 1 else (" (kv split)" if 2 % tp == 0 else " (kv replicated)")
            rows.append([family, f"tp {tp}{kv}, fp32 logits vs transformers", f"{dev:.2e}"])
        pp = (_pp2(cfg, full) - ref).abs().max().item()
        rows.append([family, "pp 2 (blocks 0 / 1), fp32 logits vs transformers", f"{pp:.2e}"])
        # a window under cp: all-to-all only (ring attention's tiles are full causal: refused by the resolver)
        for algorithm in ("all_to_all",) if cfg.sliding_window else ("ring", "all_to_all"):
            outs = run_distributed(lambda a=algorithm: _cp2(cfg, full, a), 2)
            dev = max((logits - ref[:, mine]).abs().max().item() for mine, logits in outs)
            rows.append([family, f"cp 2 ({algorithm}), fp32 logits vs transformers", f"{dev:.2e}"])
        back = megazoo_to_hf_state(full, cfg)
        theirs = {k: v for k, v in model.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
        dev = max((back[k] - v).abs().max().item() for k, v in theirs.items())
        rows.append([family, "HF -> megazoo -> HF round trip", f"{dev:.1e} ({len(theirs)} tensors)"])
    return rows


def _fp64(tp, cfg):
    topo = Topology.solo() if tp == 1 else Topology.build(dp=1, tp=tp)
    model = GPT(cfg, topo, dtype=torch.float64)
    init_weights(model, 11)
    logits = model(IDS[:, :-1])
    model.loss(logits, IDS[:, 1:]).backward()
    grads = {n: gather_full(p.grad, s, topo.tp_group) for n, p, s in named_shards(model)}
    return gather_from_tp_region(logits.detach(), topo.tp_group)[..., :V], grads


def fp64_rows() -> list[list[str]]:
    from megazoo.models.presets import get_preset

    cfg = get_preset("llama-tiny").replace(n_layer=2, vocab_size=V, d_model=64, n_head=4, n_kv_head=2, d_ff=96,
                                           n_positions=64, qkv_bias=True, sliding_window=8,
                                           rope_scaling="llama3", rope_original_positions=16)
    ref_logits, ref_grads = _fp64(1, cfg)
    rows = []
    for tp in (2, 4):
        outs = run_distributed(lambda t=tp: _fp64(t, cfg), tp)
        dl = max((o[0] - ref_logits).abs().max().item() for o in outs)
        dg = max((o[1][n][:V] - g[:V]).abs().max().item() for o in outs for n, g in ref_grads.items())
        kv = "kv split" if tp == 2 else "kv replicated"
        rows.append(["megazoo GQA (fp64)", f"tp {tp} ({kv}) vs one process: logits / grads", f"{dl:.1e} / {dg:.1e}"])
    return rows


def main() -> int:
    rows = hf_rows() + fp64_rows()
    print("| family | layout | max deviation |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
