"""Hugging Face DeepseekV3ForCausalLM (DeepSeek-V3, Kimi K2) and DeepseekV2ForCausalLM (DeepSeek-V2, V2-Lite) <->
megazoo: the configs both ways, the key map and `FAMILY`, the registry's family (models/hf/families.py; it lives here
as models/hf/ is a full room). A megazoo config is this family's when it has latent attention (model.kv_lora_rank >
0, models/deepseek/mla.py): deepseek_v2 when its experts are softmax-routed, deepseek_v3 otherwise.

The two model types share the decoder, the key map and the config fields; `VARIANTS` holds what differs. DeepSeek-V2
routes by softmax, top-k not renormalised (transformers' DeepseekV2TopkRouter ignores norm_topk_prob), times
routed_scaling_factor, either over all experts (topk_method "greedy") or within topk_group of n_group groups scored
by their best probability ("group_limited_greedy"); it has no routing bias (no e_score_correction_bias tensor) and
no multi-token prediction layers. Its rotary part rotates interleaved pairs as a complex product, the same function
as DeepseekV3's rope_interleave, so the same row permutation holds.

Under model.layers.<i>. (embedding, final norm, head, block norms and dense MLPs as models/hf/llama.py):

    ours                        HF checkpoint files
    attn.q_a / attn.c_q         self_attn.q_a_proj / self_attn.q_proj (no q compression)
    attn.q_a_norm               self_attn.q_a_layernorm
    attn.q_b                    self_attn.q_b_proj
    attn.kv_a                   self_attn.kv_a_proj_with_mqa   rows [latent; shared rotary key]
    attn.kv_a_norm              self_attn.kv_a_layernorm
    attn.kv_b                   self_attn.kv_b_proj            rows per head [k_nope; v]
    attn.c_proj                 self_attn.o_proj
    mlp.router.weight           mlp.gate.weight
    mlp.router.expert_bias      mlp.gate.e_score_correction_bias   (a buffer: the routing bias)
    mlp.experts.c_fc / c_proj   mlp.experts.<e>.gate_proj ; up_proj / down_proj  (stacked as moe_families.py)
    mlp.shared.c_fc / c_proj    mlp.shared_experts.gate_proj ; up_proj / down_proj

Rotary layout: DeepSeek's checkpoints (config rope_interleave = true, transformers' default) rotate interleaved
pairs (x0, x1), (x2, x3), ... of each head's rotary part, and transformers' rotation returns [evens; odds]; ours
rotates halves (models/rotary.py). Permuting the rotary rows of q_b (q_proj) per head and of kv_a's rotary key to
[even rows; odd rows] on reading (and back on writing) makes the two the same function: q.k is unchanged by
the same permutation of q's and k's rotary dims. Configs written here say rope_interleave = true.

Multi-token prediction (models/deepseek/mtp_hf.py): depth k as layer n_layer + k - 1, as DeepSeek-V3's published
checkpoint stores its one module (model.layers.61: embed_tokens, enorm, hnorm, eh_proj, the decoder layer's own
names, shared_head.norm, shared_head.head). Written with config.json's num_nextn_predict_layers = mtp_depth and the
two shared copies; read only where the folder's weights hold the layer (read_hf_config: held_depth), the copies
checked equal to the main embedding and head and left out. transformers ignores layer 61 on loading, and its
save_pretrained writes none (while its config says num_nextn_predict_layers = 1): such a folder reads as mtp_depth 0.
Not mapped: attention_bias (DeepSeek has none; refused).
"""

from __future__ import annotations

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.deepseek.mtp_hf import mtp_entries
from megazoo.models.hf import llama, moe_families
from megazoo.models.hf.family import Entry, Family
from megazoo.models.layout import parameter_layout

ATTENTION = {"attn.q_a": "self_attn.q_a_proj", "attn.c_q": "self_attn.q_proj", "attn.q_a_norm": "self_attn.q_a_layernorm",
             "attn.q_b": "self_attn.q_b_proj", "attn.kv_a": "self_attn.kv_a_proj_with_mqa",
             "attn.kv_a_norm": "self_attn.kv_a_layernorm", "attn.kv_b": "self_attn.kv_b_proj",
             "attn.c_proj": "self_attn.o_proj", "mlp.router": "mlp.gate"}
SHARED = {"mlp.shared.c_fc": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
          "mlp.shared.c_proj": ("mlp.shared_experts.down_proj",)}
BIAS = "mlp.router.expert_bias"


def _permute_rope(cfg: ModelConfig, heads: int, block: int, inverse: bool, tensor: torch.Tensor) -> torch.Tensor:
    """Rows: `heads` blocks of `block` rows each ending in the rotary part; its rows to [evens; odds] (inverse: back)."""
    rope = cfg.qk_rope_head_dim
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if inverse:
        order = torch.argsort(order)
    t = tensor.view(heads, block, *tensor.shape[1:])
    return torch.cat([t[:, :block - rope], t[:, block - rope:][:, order]], dim=1).reshape(tensor.shape).contiguous()


def entries(cfg: ModelConfig) -> list[Entry]:
    """The key map as read: the main model's, then the MTP layers' (less their shared copies)."""
    return _main_entries(cfg.replace(mtp_depth=0)) + mtp_entries(cfg, _main_entries)


def written_entries(cfg: ModelConfig) -> list[Entry]:
    """The key map as written: with each MTP layer's copies of the shared embedding and head."""
    return _main_entries(cfg.replace(mtp_depth=0)) + mtp_entries(cfg, _main_entries, copies=True)


# What the two model types differ in (module docstring): the transformers classes and the routing they compute.
VARIANTS = {"deepseek_v3": dict(config="DeepseekV3Config", architecture="DeepseekV3ForCausalLM", router="sigmoid_bias"),
            "deepseek_v2": dict(config="DeepseekV2Config", architecture="DeepseekV2ForCausalLM", router="softmax")}
V2_TOPK = ("greedy", "group_limited_greedy")


def _main_entries(cfg: ModelConfig) -> list[Entry]:
    out = []
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    for p in parameter_layout(cfg, vocab=cfg.vocab_size):
        if p.name in llama.TOP_LEVEL:
            out.append(Entry(p.name, (llama.TOP_LEVEL[p.name],), (p.shape,)))
            continue
        _, index, rest = p.name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        layer = f"model.layers.{index}."
        if module in moe_families.EXPERT_MODULES:
            out.append(Entry(p.name, *_expert_names(cfg, layer, module, p.shape)))
            continue
        names = SHARED.get(module) or ((ATTENTION[module],) if module in ATTENTION else llama.BLOCK_MODULES[module])
        hf = tuple(f"{layer}{n}.{kind}" for n in names)
        shapes = tuple((p.shape[0] // len(hf), *p.shape[1:]) for _ in hf)
        rope_rows = {"attn.q_b": (cfg.n_head, qk), "attn.c_q": (cfg.n_head, qk),
                     "attn.kv_a": (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)}.get(module)
        if rope_rows:
            out.append(Entry(p.name, hf, shapes,
                             join_fn=lambda ts, r=rope_rows: _permute_rope(cfg, *r, False, ts[0]),
                             split_fn=lambda t, r=rope_rows: [_permute_rope(cfg, *r, True, t)]))
        else:
            out.append(Entry(p.name, hf, shapes))
        if module == "mlp.router" and cfg.moe_router == "sigmoid_bias":  # DeepSeek-V2 has no routing bias
            out.append(Entry(f"h.{index}.{BIAS}", (f"{layer}mlp.gate.e_score_correction_bias",), ((cfg.n_experts,),)))
    return out


def _expert_names(cfg: ModelConfig, layer: str, module: str, shape) -> tuple:
    mats = ("gate_proj", "up_proj") if module.endswith("c_fc") else ("down_proj",)
    names = tuple(f"{layer}mlp.experts.{e}.{m}.weight" for e in range(cfg.n_experts) for m in mats)
    rows = shape[1] // len(mats)
    return names, ((rows, shape[2]),) * len(names), False, None, None, len(mats)  # stacked as moe_families.py


def config_from_hf(hf_config, name: str | None = None) -> ModelConfig:
    """ModelConfig of an HF DeepseekV3 / DeepseekV2 config; refuses what our decoder does not compute."""
    model_type = hf_config.model_type
    if model_type not in VARIANTS:
        raise ValueError(f"HF model_type {model_type!r} is not {' or '.join(VARIANTS)}")
    rope = llama._rope_parameters(hf_config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    unsupported = []
    if hf_config.hidden_act != "silu":
        unsupported.append(f"hidden_act={hf_config.hidden_act!r}")
    if kind not in ("default", "yarn"):
        unsupported.append(f"rope type {kind!r} (supported: default, yarn)")
    if getattr(hf_config, "attention_bias", False):
        unsupported.append("attention_bias=true")
    if not getattr(hf_config, "rope_interleave", True):
        unsupported.append("rope_interleave=false")
    if kind == "yarn" and (rope.get("attention_factor") is not None or rope.get("truncate", True) is False
                           or rope.get("factor") is None or (rope.get("mscale_all_dim") and rope.get("mscale") is None)):
        unsupported.append("yarn with attention_factor, truncate=false, no factor, or mscale_all_dim without mscale")
    if unsupported:
        raise ValueError(f"unsupported {model_type} variant: {'; '.join(unsupported)}")
    layers, dense = hf_config.num_hidden_layers, hf_config.first_k_dense_replace or 0
    fields = {}
    if dense < layers:
        fields = dict(n_experts=hf_config.n_routed_experts, moe_top_k=hf_config.num_experts_per_tok,
                      moe_d_ff=hf_config.moe_intermediate_size, moe_shared_experts=hf_config.n_shared_experts,
                      moe_first_dense=dense, moe_router="sigmoid_bias", moe_norm_topk_prob=bool(hf_config.norm_topk_prob),
                      moe_n_group=hf_config.n_group or 1, moe_topk_group=hf_config.topk_group or 1,
                      moe_routed_scaling_factor=float(hf_config.routed_scaling_factor))
        if model_type == "deepseek_v2":
            fields.update(_v2_routing(hf_config))
    if kind == "yarn":
        fields.update(rope_scaling="yarn", rope_factor=float(rope["factor"]),
                      rope_original_positions=int(rope["original_max_position_embeddings"]),
                      rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
                      rope_mscale=float(rope.get("mscale") or 1.0), rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0))
    common = llama.decoder_fields_from_hf(hf_config, model_type, name, rope)
    common["n_kv_head"] = common["n_head"]  # latent attention: every head its own keys and values
    return ModelConfig(**common, mlp_bias=False, qkv_bias=False, proj_bias=False,
                       kv_lora_rank=hf_config.kv_lora_rank, q_lora_rank=hf_config.q_lora_rank or 0,
                       qk_nope_head_dim=hf_config.qk_nope_head_dim, qk_rope_head_dim=hf_config.qk_rope_head_dim,
                       v_head_dim=hf_config.v_head_dim, **fields)


def _v2_routing(hf_config) -> dict:
    """DeepSeek-V2's router fields (module docstring); refuses the topk_method and norm_topk_prob it does not use."""
    method = hf_config.topk_method
    if method not in V2_TOPK:
        raise ValueError(f"unsupported deepseek_v2 variant: topk_method={method!r} (supported: {', '.join(V2_TOPK)})")
    if hf_config.norm_topk_prob:
        raise ValueError("unsupported deepseek_v2 variant: norm_topk_prob=true (transformers' DeepseekV2 never "
                         "renormalises the top-k weights, so the flag would mean two models)")
    grouped = method == "group_limited_greedy"
    return dict(moe_router="softmax", moe_norm_topk_prob=False, moe_n_group=hf_config.n_group if grouped else 1,
                moe_topk_group=hf_config.topk_group if grouped else 1)


def model_type(cfg: ModelConfig) -> str:
    """The HF model_type a latent-attention config is written as: deepseek_v2 for softmax-routed experts."""
    return "deepseek_v2" if cfg.n_experts and cfg.moe_router == "softmax" else "deepseek_v3"


def exports(cfg: ModelConfig) -> str | None:
    """model_type(cfg) for a latent-attention config (ValueError for what that model type does not compute), else
    None."""
    if not cfg.mla:
        return None
    kind = model_type(cfg)
    wrong = []
    if cfg.mlp != "swiglu" or cfg.mlp_bias:
        wrong.append(f"model.mlp = {cfg.mlp!r}, mlp_bias = {cfg.mlp_bias}")
    if cfg.n_experts:
        if cfg.moe_router not in ("sigmoid_bias", "softmax"):
            wrong.append(f"model.moe_router = {cfg.moe_router!r} (DeepseekV3: 'sigmoid_bias', DeepseekV2: 'softmax')")
        if kind == "deepseek_v2" and cfg.moe_norm_topk_prob:
            wrong.append("model.moe_norm_topk_prob = true with moe_router = 'softmax' (DeepseekV2 never renormalises)")
        if kind == "deepseek_v2" and cfg.mtp_depth:
            wrong.append(f"model.mtp_depth = {cfg.mtp_depth} (DeepseekV2 has no multi-token prediction layers)")
        if cfg.moe_every != 1 or cfg.moe_dense_layers or cfg.moe_shared_gate:
            wrong.append("model.moe_every / moe_dense_layers / moe_shared_gate (DeepSeek: only the first k dense)")
        if cfg.moe_shared_experts < 1 or cfg.moe_shared_d_ff != cfg.moe_d_ff:
            wrong.append("shared experts other than n_shared_experts of moe_d_ff each (DeepSeek always has them)")
    if wrong:
        raise ValueError(f"model {cfg.name}: HF {kind} does not compute {'; '.join(wrong)}")
    return kind


def config_to_hf(cfg: ModelConfig, special: dict[str, int | None] | None = None):
    import transformers

    variant = VARIANTS[exports(cfg)]
    v2 = variant["router"] == "softmax"
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope = dict(rope, rope_type="yarn", factor=cfg.rope_factor, original_max_position_embeddings=cfg.rope_original_positions,
                    beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, mscale=cfg.rope_mscale,
                    mscale_all_dim=cfg.rope_mscale_all_dim)
    moe = dict(n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
               moe_intermediate_size=cfg.moe_d_ff, n_shared_experts=cfg.moe_shared_experts,
               first_k_dense_replace=cfg.moe_first_dense, norm_topk_prob=cfg.moe_norm_topk_prob,
               n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
               routed_scaling_factor=cfg.moe_routed_scaling_factor) if cfg.n_experts else \
        dict(first_k_dense_replace=cfg.n_layer, n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1)
    if v2:
        moe["topk_method"] = V2_TOPK[cfg.moe_n_group > 1]
    fields = llama.decoder_fields_to_hf(cfg, variant["architecture"], rope, special)
    fields["num_key_value_heads"] = cfg.n_head
    own = {} if v2 else dict(rope_interleave=True, num_nextn_predict_layers=cfg.mtp_depth)
    return getattr(transformers, variant["config"])(
        **fields, attention_bias=False, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, **own, **moe)


FAMILY = Family(
    name="DeepSeek", model_types=("deepseek_v3", "deepseek_v2"), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    exports=exports, entries=entries,
    tied_head=lambda cfg: ("lm_head.weight", llama.TOP_LEVEL["wte.weight"]) if cfg.tie_embeddings else None,
    # the MTP layers' copies of the embedding and head: checked on reading (converter.megazoo_tensors), not kept
    ignored=llama._IGNORED_SUFFIXES + (".embed_tokens.weight", "shared_head.head.weight"), fp32_in_hf=True,
    mtp=True, written=written_entries)
