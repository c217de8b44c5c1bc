"""Hugging Face MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM / Qwen3ForCausalLM <-> megazoo:
the configs both ways, and `FAMILY`, the registry's family (models/hf/families.py) whose key map is
models/hf/moe_keys.py. Every command converts through it: `megazoo convert` both ways (--verify, --merge-lora),
`eval --hf`, `generate --hf` and `model.from_hf`.

Which family a megazoo config is written as follows from its fields (`hf_family`): experts with a gated shared
expert are Qwen2-MoE; experts with per-head q/k norms Qwen3-MoE; experts without Mixtral (every layer MoE,
renormalised top-k); per-head q/k norms without experts Qwen3. Anything else is refused with the field that no
family computes. Attention, rotary and norms are llama.py's (the same HF arithmetic).
"""

from __future__ import annotations

from pathlib import Path

from megazoo.models.config import ModelConfig
from megazoo.models.hf import llama, moe_keys
from megazoo.models.hf.family import Entry, Family

FAMILIES = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def hf_family(cfg: ModelConfig) -> str:
    """The HF family computing `cfg` (module docstring), or ValueError naming what none computes."""
    if cfg.norm != "rmsnorm" or cfg.positions != "rotary" or cfg.mlp != "swiglu" or cfg.mlp_bias:
        raise ValueError(f"model {cfg.name} is not Llama-style (norm, positions, mlp, mlp_bias)")
    wrong = []
    if cfg.sliding_window:
        wrong.append(f"model.sliding_window = {cfg.sliding_window}")
    if cfg.n_experts and (cfg.moe_first_dense or cfg.moe_router != "softmax"):
        wrong.append(f"model.moe_first_dense = {cfg.moe_first_dense}, moe_router = {cfg.moe_router!r}")
    if cfg.moe_shared_experts and not (cfg.moe_shared_gate and cfg.moe_shared_experts == 1 and not cfg.qk_norm):
        wrong.append("shared experts other than Qwen2-MoE's one gated shared expert")
    if wrong:
        raise ValueError(f"model {cfg.name}: no HF family computes {'; '.join(wrong)}")
    if cfg.moe_shared_experts:
        family = "qwen2_moe"
        if not cfg.qkv_bias or cfg.proj_bias:
            raise ValueError(f"model {cfg.name}: Qwen2-MoE has q/k/v bias and no output bias")
    elif cfg.n_experts:
        family = "qwen3_moe" if cfg.qk_norm else "mixtral"
        if family == "mixtral" and (not cfg.moe_norm_topk_prob or cfg.moe_every != 1 or cfg.moe_dense_layers):
            raise ValueError(f"model {cfg.name}: Mixtral renormalises the top-k and has experts in every layer")
    elif cfg.qk_norm:
        family = "qwen3"
    else:
        raise ValueError(f"model {cfg.name} has neither experts nor q/k norms: export it with models/hf/llama.py")
    if family in ("mixtral",) and (cfg.qkv_bias or cfg.proj_bias):
        raise ValueError(f"model {cfg.name}: Mixtral has no attention bias")
    if family in ("qwen3", "qwen3_moe") and cfg.qkv_bias != cfg.proj_bias:
        raise ValueError(f"model {cfg.name}: Qwen3's attention_bias covers q/k/v and the output together")
    return family


def config_from_hf(hf_config, name: str | None = None) -> ModelConfig:
    """ModelConfig of an HF Mixtral / Qwen2-MoE / Qwen3-MoE / Qwen3 config; refuses what our decoder lacks."""
    family = hf_config.model_type
    if family not in FAMILIES:
        raise ValueError(f"HF model_type {family!r} is not an MoE / Qwen3 family; valid: {', '.join(FAMILIES)}")
    d, heads = hf_config.hidden_size, hf_config.num_attention_heads
    rope = llama._rope_parameters(hf_config)
    unsupported = []
    if hf_config.hidden_act != "silu":
        unsupported.append(f"hidden_act={hf_config.hidden_act!r}")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"rope type {rope.get('rope_type')!r} (supported: default)")
    if getattr(hf_config, "sliding_window", None) and (family == "mixtral"
                                                       or getattr(hf_config, "use_sliding_window", False)):
        unsupported.append(f"sliding_window={hf_config.sliding_window}")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        unsupported.append("router_jitter_noise")
    if unsupported:
        raise ValueError(f"unsupported {family} variant: {'; '.join(unsupported)}")
    bias = bool(getattr(hf_config, "attention_bias", False))
    fields = dict(qkv_bias=bias, proj_bias=bias)
    if family == "qwen2_moe":
        fields = dict(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)), proj_bias=False)
    if family in ("qwen3", "qwen3_moe"):
        fields["qk_norm"] = True
    if family == "mixtral":
        fields.update(n_experts=hf_config.num_local_experts, moe_top_k=hf_config.num_experts_per_tok,
                      moe_norm_topk_prob=True)
    elif family != "qwen3":
        fields.update(n_experts=hf_config.num_experts, moe_top_k=hf_config.num_experts_per_tok,
                      moe_d_ff=hf_config.moe_intermediate_size, moe_norm_topk_prob=bool(hf_config.norm_topk_prob),
                      moe_every=hf_config.decoder_sparse_step,
                      moe_dense_layers=tuple(hf_config.mlp_only_layers or ()))
    if family == "qwen2_moe":
        fields.update(moe_shared_experts=1, moe_shared_d_ff=hf_config.shared_expert_intermediate_size,
                      moe_shared_gate=True)
    if family != "qwen3":
        fields["moe_aux_loss_coef"] = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    return ModelConfig(
        name=name or Path(getattr(hf_config, "name_or_path", "") or f"hf-{family}").name or f"hf-{family}",
        n_layer=hf_config.num_hidden_layers, n_head=heads, n_kv_head=hf_config.num_key_value_heads or heads,
        d_model=d, d_ff=hf_config.intermediate_size, n_positions=hf_config.max_position_embeddings,
        head_width=0 if (getattr(hf_config, "head_dim", None) or d // heads) * heads == d else hf_config.head_dim,
        vocab_size=hf_config.vocab_size, norm="rmsnorm", positions="rotary", mlp="swiglu", mlp_bias=False,
        layer_norm_eps=hf_config.rms_norm_eps, tie_embeddings=bool(hf_config.tie_word_embeddings),
        rope_theta=float(rope.get("rope_theta", 10000.0)), dropout=0.0,
        attn_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_std=hf_config.initializer_range, **fields)


def config_to_hf(cfg: ModelConfig, special: dict[str, int | None] | None = None):
    """The HF config of `cfg`'s family (hf_family)."""
    import transformers

    family = hf_family(cfg)
    config_class, architecture = FAMILIES[family]
    fields = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                  num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                  head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.n_positions,
                  rms_norm_eps=cfg.layer_norm_eps, initializer_range=cfg.init_std,
                  tie_word_embeddings=cfg.tie_embeddings, attention_dropout=cfg.attn_dropout,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  architectures=[architecture], **(special or {}))
    if family == "mixtral":
        fields.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                      intermediate_size=cfg.moe_d_ff, sliding_window=None)
    elif family != "qwen3":
        fields.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k,
                      moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.moe_norm_topk_prob,
                      decoder_sparse_step=cfg.moe_every, mlp_only_layers=list(cfg.moe_dense_layers),
                      use_sliding_window=False)
    if family == "qwen2_moe":
        fields.update(shared_expert_intermediate_size=cfg.moe_shared_d_ff, qkv_bias=cfg.qkv_bias)
    else:
        fields.update(attention_bias=cfg.qkv_bias)
    if family != "qwen3":
        fields["router_aux_loss_coef"] = cfg.moe_aux_loss_coef
    else:
        fields["use_sliding_window"] = False
    return getattr(transformers, config_class)(**fields)


def exports(cfg: ModelConfig) -> str | None:
    """The model_type `cfg` is written as: None unless it has experts or q/k norms (GPT-2's and Llama's then)."""
    if cfg.positions == "learned" or not (cfg.n_experts or cfg.qk_norm):
        return None
    return hf_family(cfg)


def entries(cfg: ModelConfig) -> list[Entry]:
    return moe_keys.entries(hf_family(cfg), cfg)


FAMILY = Family(
    name="MoE / Qwen3", model_types=tuple(FAMILIES), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    exports=exports, entries=entries,
    tied_head=lambda cfg: ("lm_head.weight", llama.TOP_LEVEL["wte.weight"]) if cfg.tie_embeddings else None,
    ignored=llama._IGNORED_SUFFIXES,
    fp32_in_hf=True)  # RMSNorm and rotary as llama.py's families
