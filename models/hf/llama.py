"""Hugging Face LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM checkpoints <-> megazoo weights.

The three families share HF's Llama layout; megazoo's names differ only where our projections are fused so that
one column-parallel layer splits them by whole heads over tp (models/layout.py):

    ours                         HF (model.layers.<i>. ...)                 how
    wte.weight                   model.embed_tokens.weight
    h.<i>.ln_1 / ln_2            input_layernorm / post_attention_layernorm
    h.<i>.attn.c_q               self_attn.q_proj                           grouped-query attention
    h.<i>.attn.c_kv              [self_attn.k_proj; self_attn.v_proj]       rows concatenated
    h.<i>.attn.c_attn            [q_proj; k_proj; v_proj]                   multi-head (n_kv_head = n_head)
    h.<i>.attn.c_proj            self_attn.o_proj
    h.<i>.mlp.c_fc               [mlp.gate_proj; mlp.up_proj]               rows concatenated
    h.<i>.mlp.c_proj             mlp.down_proj
    ln_f.weight                  model.norm.weight
    lm_head.weight               lm_head.weight                             untied only (a tied one is dropped)

Weights are torch.nn.Linear's (out, in) on both sides and HF's q/k rows are already in the rotate-half order our
rotary uses (models/rotary.py), so nothing is transposed or permuted. Which HF family a megazoo config is written
as follows from its fields (`hf_family`): q/k/v bias without an output bias is Qwen2, a sliding window Mistral,
everything else Llama (whose attention_bias puts a bias on all four projections).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.hf.family import Entry, Family, exported_config
from megazoo.models.layout import parameter_layout

# Our block module -> the HF modules whose rows it concatenates (under model.layers.<i>.).
BLOCK_MODULES = {
    "ln_1": ("input_layernorm",), "ln_2": ("post_attention_layernorm",),
    "attn.c_q": ("self_attn.q_proj",), "attn.c_kv": ("self_attn.k_proj", "self_attn.v_proj"),
    "attn.c_attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.c_proj": ("self_attn.o_proj",),
    "mlp.c_fc": ("mlp.gate_proj", "mlp.up_proj"), "mlp.c_proj": ("mlp.down_proj",),
}
TOP_LEVEL = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM")}
# Buffers some HF checkpoints carry that hold no weights (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_names(name: str) -> list[str]:
    """The HF tensor names whose rows (in order) make our parameter `name`."""
    if name in TOP_LEVEL:
        return [TOP_LEVEL[name]]
    _, index, rest = name.split(".", 2)  # h.<i>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return [f"model.layers.{index}.{hf}.{kind}" for hf in BLOCK_MODULES[module]]


def split_sizes(cfg: ModelConfig, name: str) -> list[int]:
    """Rows of each HF tensor inside our parameter `name` (hf_names' order)."""
    hd = cfg.head_dim
    if ".attn.c_kv." in name:
        return [cfg.n_kv_head * hd] * 2
    if ".attn.c_attn." in name:
        return [cfg.d_model] * 3
    if ".mlp.c_fc." in name:
        return [cfg.d_ff] * 2
    return []


def entries(cfg: ModelConfig) -> list[Entry]:
    """The Llama families' key map (models/hf/families.py): the table in the module docstring."""
    out = []
    for p in parameter_layout(cfg, vocab=cfg.vocab_size):
        sizes = split_sizes(cfg, p.name)
        shapes = tuple((size, *p.shape[1:]) for size in sizes) if sizes else (p.shape,)
        out.append(Entry(p.name, tuple(hf_names(p.name)), shapes))
    return out


def hf_to_megazoo_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full megazoo state (embedding / head at the true vocabulary) from an HF Llama-family state dict."""
    full, used = {}, set()
    missing = []
    for spec in parameter_layout(cfg, vocab=cfg.vocab_size):
        names = hf_names(spec.name)
        absent = [n for n in names if n not in hf_state]
        if absent:
            missing += absent
            continue
        used.update(names)
        tensor = torch.cat([hf_state[n] for n in names]) if len(names) > 1 else hf_state[names[0]]
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"HF tensor(s) {names} have shape {tuple(tensor.shape)}; model {cfg.name} expects "
                             f"{spec.shape} for {spec.name}")
        full[spec.name] = tensor
    if missing:
        raise ValueError(f"HF state lacks {len(missing)} tensor(s) of model {cfg.name}, e.g. {missing[:8]}")
    if cfg.tie_embeddings and "lm_head.weight" in hf_state:
        used.add("lm_head.weight")
        if not torch.equal(hf_state["lm_head.weight"], full["wte.weight"]):
            raise ValueError("lm_head.weight differs from model.embed_tokens.weight but the config ties them "
                             "(tie_word_embeddings=True)")
    unexpected = sorted(n for n in set(hf_state) - used if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"HF state has {len(unexpected)} tensor(s) model {cfg.name} does not hold, e.g. "
                         f"{unexpected[:8]}")
    return full


def megazoo_to_hf_state(full_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF state dict (without a tied lm_head.weight) from a full megazoo state."""
    expected = {p.name: p.shape for p in parameter_layout(cfg, vocab=cfg.vocab_size)}
    if set(expected) != set(full_state):
        raise ValueError(f"state does not match model {cfg.name}: missing {sorted(set(expected) - set(full_state))[:8]}"
                         f", unexpected {sorted(set(full_state) - set(expected))[:8]}")
    hf = {}
    for name, tensor in full_state.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, model {cfg.name} expects {expected[name]}")
        sizes = split_sizes(cfg, name)
        pieces = tensor.split(sizes) if sizes else [tensor]
        for hf_name, piece in zip(hf_names(name), pieces, strict=True):
            hf[hf_name] = piece.contiguous()
    return hf


def hf_family(cfg: ModelConfig) -> str:
    """The HF family that computes `cfg`'s function: "qwen2", "mistral" or "llama" (see the module docstring)."""
    if cfg.n_experts or cfg.qk_norm:
        raise ValueError(f"model {cfg.name} has experts or q/k norms: its HF family is Mixtral / Qwen2-MoE / "
                         "Qwen3-MoE / Qwen3 (models/hf/moe_families.py)")
    if cfg.norm != "rmsnorm" or cfg.positions != "rotary" or cfg.mlp != "swiglu":
        raise ValueError(f"model {cfg.name} is not Llama-style (norm={cfg.norm!r}, positions={cfg.positions!r}, "
                         f"mlp={cfg.mlp!r}): export it as GPT-2 or set rmsnorm / rotary / swiglu")
    if cfg.qkv_bias and not cfg.proj_bias:
        if cfg.mlp_bias or cfg.sliding_window:
            raise ValueError(f"model {cfg.name}: Qwen2 has no MLP bias and no sliding window on every layer")
        return "qwen2"
    if cfg.sliding_window:
        if cfg.qkv_bias or cfg.proj_bias or cfg.mlp_bias:
            raise ValueError(f"model {cfg.name}: a sliding window with biases has no HF family (Mistral has none)")
        return "mistral"
    if cfg.qkv_bias != cfg.proj_bias:
        raise ValueError(f"model {cfg.name}: HF Llama's attention_bias covers q/k/v and the output projection "
                         f"together (model.qkv_bias = {cfg.qkv_bias}, model.proj_bias = {cfg.proj_bias})")
    return "llama"


def _rope_parameters(hf_config) -> dict:
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not rope:  # configs from before transformers 5: rope_theta + rope_scaling
        rope = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return rope


def decoder_fields_from_hf(hf_config, family: str, name: str | None, rope: dict) -> dict:
    """The ModelConfig fields every RMSNorm + rotary + SwiGLU family reads alike from its HF config (Llama-style
    and the MoE families): sizes, norms, tying, rope theta, dropout, init; the caller adds its family's own."""
    heads = hf_config.num_attention_heads
    return dict(
        name=name or Path(getattr(hf_config, "name_or_path", "") or f"hf-{family}").name or f"hf-{family}",
        n_layer=hf_config.num_hidden_layers, n_head=heads, n_kv_head=hf_config.num_key_value_heads or heads,
        d_model=hf_config.hidden_size, d_ff=hf_config.intermediate_size, n_positions=hf_config.max_position_embeddings,
        vocab_size=hf_config.vocab_size, norm="rmsnorm", positions="rotary", mlp="swiglu",
        layer_norm_eps=hf_config.rms_norm_eps, tie_embeddings=bool(hf_config.tie_word_embeddings),
        rope_theta=float(rope.get("rope_theta", 10000.0)), dropout=0.0,
        attn_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0), init_std=hf_config.initializer_range)


def decoder_fields_to_hf(cfg: ModelConfig, architecture: str, rope: dict,
                         special: dict[str, int | None] | None = None) -> dict:
    """decoder_fields_from_hf's way back: the HF config fields of `cfg` every such family writes alike."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                hidden_act="silu", max_position_embeddings=cfg.n_positions, rms_norm_eps=cfg.layer_norm_eps,
                initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
                attention_dropout=cfg.attn_dropout, rope_parameters=rope, architectures=[architecture],
                **(special or {}))


def config_from_hf(hf_config, name: str | None = None) -> ModelConfig:
    """ModelConfig of an HF LlamaConfig / Qwen2Config / MistralConfig; refuses what our decoder does not compute."""
    family = hf_config.model_type
    if family not in FAMILIES:
        raise ValueError(f"HF model_type {family!r} is not a Llama-style family; valid: {', '.join(FAMILIES)}")
    d, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or d // heads
    rope = _rope_parameters(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = []
    if hf_config.hidden_act != "silu":
        unsupported.append(f"hidden_act={hf_config.hidden_act!r} (ours is SwiGLU: silu)")
    if head_dim * heads != d:
        unsupported.append(f"head_dim={head_dim} with hidden_size={d} and {heads} heads (ours: hidden / heads)")
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"rope type {rope_type!r} (supported: default, llama3)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported.append("partial rotary")
    window = 0
    if family == "mistral":
        window = hf_config.sliding_window or 0
    elif family == "qwen2":
        kinds = set(getattr(hf_config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            if kinds != {"sliding_attention"}:
                unsupported.append("a sliding window on some layers only (max_window_layers)")
            window = hf_config.sliding_window or 0
    if unsupported:
        raise ValueError(f"unsupported {family} variant: {'; '.join(unsupported)}")
    attention_bias = family == "llama" and bool(getattr(hf_config, "attention_bias", False))
    scaling = {}
    if rope_type == "llama3":
        scaling = dict(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_positions=int(rope["original_max_position_embeddings"]))
    return ModelConfig(**decoder_fields_from_hf(hf_config, family, name, rope),
                       qkv_bias=family == "qwen2" or attention_bias, proj_bias=attention_bias,
                       mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), sliding_window=window, **scaling)


def config_to_hf(cfg: ModelConfig, special: dict[str, int | None] | None = None):
    """The HF config (LlamaConfig, Qwen2Config or MistralConfig: hf_family) computing `cfg`'s function."""
    import transformers

    family = hf_family(cfg)
    config_class, architecture = FAMILIES[family]
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_positions)
    fields = decoder_fields_to_hf(cfg, architecture, rope, special)
    if family == "llama":
        fields.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, head_dim=cfg.head_dim)
    elif family == "mistral":
        fields.update(sliding_window=cfg.sliding_window, head_dim=cfg.head_dim)
    else:
        fields.update(use_sliding_window=False)
    return getattr(transformers, config_class)(**fields)


def export_hf_dir(full_state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                  tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write an HF checkpoint of `cfg`'s family (config.json, generation_config.json, safetensors in `dtype`,
    default the state's own) that AutoModelForCausalLM.from_pretrained loads, through the one converter
    (models/hf/converter.py); with `tokenizer` (a megazoo Tokenizer) also its HF tokenizer, whose special ids
    become the model's bos / eos / pad."""
    from megazoo.models.hf.converter import write_hf_folder

    held = exported_config(FAMILY, cfg)  # multi-token prediction modules: no place in these formats, left out
    megazoo_to_hf_state({k: v for k, v in full_state.items() if held.mtp_depth or not k.startswith("mtp.")},
                        held)  # names and shapes checked before anything is written
    write_hf_folder(out_dir, FAMILY, cfg, full_state.__getitem__, dtype or next(iter(full_state.values())).dtype,
                    tokenizer=tokenizer)
    return Path(out_dir)



# torchtitan's Llama 3 names (its torch.distributed.checkpoint folders): HF's tensors renamed, and the q / k rows of
# each head in Meta's interleaved rotary order (pairs (2i, 2i+1)) rather than HF's rotate-half halves (i, i + hd/2).
TORCHTITAN_NAMES = (("model.embed_tokens.", "tok_embeddings."), ("model.norm.", "norm."), ("lm_head.", "output."),
                    ("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
                    ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
                    ("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"),
                    ("mlp.down_proj", "feed_forward.w2"), ("input_layernorm", "attention_norm"),
                    ("post_attention_layernorm", "ffn_norm"), ("model.layers.", "layers."))


def interleaved(w: torch.Tensor, heads: int, back: bool = False) -> torch.Tensor:
    """q / k rows per head from rotate-half order to interleaved pairs (back: the inverse)."""
    half = w.shape[0] // heads // 2
    view = (heads, half, 2) if back else (heads, 2, half)
    return w.reshape(*view, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def torchtitan_entries(cfg: ModelConfig) -> list[Entry]:
    """The key map of a torchtitan Llama 3 state dict (models/hf/family.py's Entry, names renamed, q / k reordered)."""
    if cfg.qkv_bias or cfg.proj_bias or cfg.mlp_bias or cfg.tie_embeddings or cfg.sliding_window:
        raise ValueError(f"model {cfg.name}: torchtitan's Llama 3 has no biases, tied head or sliding window")
    out = []
    for e in entries(cfg):
        names = tuple(_torchtitan(n) for n in e.hf)
        heads = [cfg.n_head if n.endswith(".wq.weight") else cfg.n_kv_head if n.endswith(".wk.weight") else 0
                 for n in names]
        if not any(heads):
            out.append(dataclasses.replace(e, hf=names))
            continue
        out.append(dataclasses.replace(
            e, hf=names,
            join_fn=lambda ts, e=e, heads=heads: e.join([interleaved(t, h, back=True) if h else t
                                                         for t, h in zip(ts, heads)]),
            split_fn=lambda t, e=e, heads=heads: [interleaved(p, h) if h else p for p, h in zip(e.split(t), heads)]))
    return out


def _torchtitan(hf_name: str) -> str:
    for ours, theirs in TORCHTITAN_NAMES:
        hf_name = hf_name.replace(ours, theirs)
    return hf_name


FAMILY = Family(
    name="Llama", model_types=tuple(FAMILIES), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    # experts or q/k norms: moe_families.py's FAMILY
    exports=lambda cfg: None if cfg.positions == "learned" or cfg.n_experts or cfg.qk_norm else hf_family(cfg),
    entries=entries,
    tied_head=lambda cfg: ("lm_head.weight", TOP_LEVEL["wte.weight"]) if cfg.tie_embeddings else None,
    ignored=_IGNORED_SUFFIXES,
    # LlamaRMSNorm normalises in fp32 and the rotary embedding computes angles in fp32, even in an fp64 model
    fp32_in_hf=True, torchtitan=torchtitan_entries)
