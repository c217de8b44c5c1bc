"""Hugging Face MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM / Qwen3ForCausalLM <-> megazoo:
the configs both ways and whole state dicts through the key maps of models/hf/moe_keys.py.

Which family a megazoo config is written as follows from its fields (`hf_family`): experts with a gated shared
expert are Qwen2-MoE; experts with per-head q/k norms Qwen3-MoE; experts without Mixtral (every layer MoE,
renormalised top-k); per-head q/k norms without experts Qwen3. Anything else is refused with the field that no
family computes. Attention, rotary and norms are llama.py's (the same HF arithmetic).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.hf import llama, moe_keys
from megazoo.models.layout import parameter_layout

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


def hf_to_megazoo_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig,
                        family: str | None = None) -> dict[str, torch.Tensor]:
    """Full megazoo state (true vocabulary) from an HF state dict, hub or transformers-5 form (moe_keys.py)."""
    family = family or hf_family(cfg)
    full, used, missing = {}, set(), []
    for spec in parameter_layout(cfg, vocab=cfg.vocab_size):
        tensor, names = moe_keys.to_megazoo(family, cfg, spec.name, spec.shape, hf_state)
        if tensor is None:
            missing += names
            continue
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"HF tensor(s) {names[:4]} make shape {tuple(tensor.shape)}; model {cfg.name} expects "
                             f"{spec.shape} for {spec.name}")
        used.update(names)
        full[spec.name] = tensor
    if missing:
        raise ValueError(f"HF state lacks {len(missing)} tensor(s) of model {cfg.name}, e.g. {missing[:8]}")
    if cfg.tie_embeddings and "lm_head.weight" in hf_state:
        used.add("lm_head.weight")
    unexpected = sorted(n for n in set(hf_state) - used if not n.endswith(llama._IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"HF state has {len(unexpected)} tensor(s) model {cfg.name} does not hold, e.g. "
                         f"{unexpected[:8]}")
    return full


def megazoo_to_hf_state(full_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The hub-form HF state dict (without a tied lm_head.weight) of a full megazoo state."""
    family = hf_family(cfg)
    expected = {p.name: p.shape for p in parameter_layout(cfg, vocab=cfg.vocab_size)}
    if set(expected) != set(full_state):
        raise ValueError(f"state does not match model {cfg.name}: missing {sorted(set(expected) - set(full_state))[:8]}"
                         f", unexpected {sorted(set(full_state) - set(expected))[:8]}")
    hf = {}
    for name, tensor in full_state.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, model {cfg.name} expects {expected[name]}")
        hf.update(moe_keys.to_hf(family, cfg, name, tensor))
    return hf


def read_hf_dir(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, full megazoo state) of an HF Mixtral / Qwen2-MoE / Qwen3-MoE / Qwen3 checkpoint directory."""
    from transformers import AutoConfig

    from megazoo.models.hf.gpt2 import read_hf_state_dict

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"HF checkpoint directory {hf_dir} has no config.json")
    try:
        hf_config = AutoConfig.from_pretrained(str(hf_dir))
    except Exception as error:  # transformers raises OSError / ValueError / JSON errors for bad configs
        raise ValueError(f"cannot read HF config {hf_dir / 'config.json'}: {error}") from error
    cfg = config_from_hf(hf_config, name=hf_dir.resolve().name)
    return cfg, hf_to_megazoo_state(read_hf_state_dict(hf_dir), cfg, hf_config.model_type)


def export_hf_dir(full_state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                  tokenizer=None) -> Path:
    """An HF checkpoint directory (config.json, generation_config.json, model.safetensors[, tokenizer]) of
    `cfg`'s family that AutoModelForCausalLM.from_pretrained loads."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from megazoo.models.hf.tokenizer_export import save_hf_tokenizer, special_ids

    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but model {cfg.name} only {cfg.vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_state = megazoo_to_hf_state(full_state, cfg)
    config = config_to_hf(cfg, special_ids(tokenizer) if tokenizer is not None else None)
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    save_file({k: v.detach().cpu().contiguous() for k, v in hf_state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, out_dir, max_length=cfg.n_positions)
    return out_dir
