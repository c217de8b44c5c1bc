"""Hugging Face MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM / Qwen3ForCausalLM <-> megazoo:
the configs both ways, the key map, and `FAMILY`, the registry's family (models/hf/families.py, family.py says
what a family is). Every command converts through it: `megazoo convert` both ways (--verify, --merge-lora,
--peft-adapter), `eval --hf`, `generate --hf`, `model.from_hf` and `checkpoint.export_hf`.

Which family a megazoo config is written as follows from its fields (`hf_family`): experts with a gated shared
expert are Qwen2-MoE; experts with per-head q/k norms Qwen3-MoE; experts without Mixtral (every layer MoE,
renormalised top-k); per-head q/k norms without experts Qwen3. Anything else is refused with the field that no
family computes. Attention, rotary and norms are llama.py's (the same HF arithmetic).

Attention, norms, embedding, head and dense MLPs follow models/hf/llama.py's map (Qwen3 adds the per-head norms
self_attn.q_norm / k_norm <-> attn.q_norm / k_norm). What is new is the MoE block (under model.layers.<i>.):

    ours                        HF checkpoint files
    mlp.router.weight           mixtral: block_sparse_moe.gate.weight ; qwen*_moe: mlp.gate.weight
    mlp.experts.c_fc.weight     per expert e, rows [gate; up]:
      (E, 2 f, d)               mixtral: block_sparse_moe.experts.<e>.w1 ; w3
                                qwen*_moe: mlp.experts.<e>.gate_proj ; up_proj
    mlp.experts.c_proj.weight   mixtral: block_sparse_moe.experts.<e>.w2
      (E, d, f)                 qwen*_moe: mlp.experts.<e>.down_proj
    mlp.shared.c_fc             qwen2_moe: [mlp.shared_expert.gate_proj; up_proj]
    mlp.shared.c_proj           qwen2_moe: mlp.shared_expert.down_proj
    mlp.shared_gate.weight      qwen2_moe: mlp.shared_expert_gate.weight

The files hold one tensor per expert in every transformers version: transformers 5 fuses them into
experts.gate_up_proj (E, 2 f, d) / experts.down_proj (E, d, f) only in memory, and its save_pretrained writes
the per-expert form back (tests/models/moe/test_moe_hf.py compares our export with it), so the map reads and writes that form.
An expert entry stacks its experts' tensors ([gate_e; up_e] or down_e per expert e: Entry.stacked), so a rank
holding some of the experts (ep) reads only theirs.
"""

from __future__ import annotations

from megazoo.models.config import ModelConfig
from megazoo.models.hf import llama
from megazoo.models.hf.family import Entry, Family
from megazoo.models.layout import parameter_layout

# The HF module prefix of the MoE block in the files, and the names of one expert's three matrices.
MOE_PREFIX = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp", "qwen3_moe": "mlp"}
EXPERT_MATRICES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                   "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
# Non-expert modules of the MoE block: ours -> HF's (under model.layers.<i>.), as llama.BLOCK_MODULES.
SHARED_MODULES = {"mlp.shared.c_fc": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                  "mlp.shared.c_proj": ("mlp.shared_expert.down_proj",),
                  "mlp.shared_gate": ("mlp.shared_expert_gate",)}
QK_NORM_MODULES = {"attn.q_norm": ("self_attn.q_norm",), "attn.k_norm": ("self_attn.k_norm",)}
EXPERT_MODULES = ("mlp.experts.c_fc", "mlp.experts.c_proj")


def _split(name: str) -> tuple[str, str, str]:
    _, index, rest = name.split(".", 2)  # h.<i>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return index, module, kind


def hf_names(family: str, cfg: ModelConfig, name: str) -> list[str]:
    """The HF tensor names that make our parameter `name` (stacked experts: expert by expert, gate before up)."""
    if name in llama.TOP_LEVEL:
        return [llama.TOP_LEVEL[name]]
    index, module, kind = _split(name)
    layer = f"model.layers.{index}."
    if module == "mlp.router":
        return [f"{layer}{MOE_PREFIX[family]}.gate.{kind}"]
    if module in EXPERT_MODULES:
        gate, up, down = EXPERT_MATRICES[family]
        mats = (gate, up) if module.endswith("c_fc") else (down,)
        return [f"{layer}{MOE_PREFIX[family]}.experts.{e}.{m}.{kind}" for e in range(cfg.n_experts) for m in mats]
    modules = SHARED_MODULES.get(module) or QK_NORM_MODULES.get(module) or llama.BLOCK_MODULES[module]
    return [f"{layer}{hf}.{kind}" for hf in modules]


def _row_sizes(cfg: ModelConfig, module: str, rows: int) -> list[int]:
    """Rows of each HF tensor inside a row-concatenated parameter of `rows` rows (hf_names' order); [] for a
    lone tensor. q is n_head x head_dim rows, which Qwen3 lets differ from d_model."""
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    return {"attn.c_attn": [q, kv, kv], "attn.c_kv": [kv, kv], "mlp.c_fc": [rows // 2] * 2,
            "mlp.shared.c_fc": [rows // 2] * 2}.get(module, [])


def family_entries(family: str, cfg: ModelConfig) -> list[Entry]:
    """Every megazoo parameter of `cfg` with the HF tensors of `family` it is made of (the module docstring)."""
    out = []
    for p in parameter_layout(cfg, vocab=cfg.vocab_size):
        names = tuple(hf_names(family, cfg, p.name))
        module = _split(p.name)[1] if p.name.startswith("h.") else ""
        if module in EXPERT_MODULES:
            per_expert = len(names) // cfg.n_experts
            rows = p.shape[1] // per_expert
            out.append(Entry(p.name, names, ((rows, p.shape[2]),) * len(names), stacked=per_expert))
            continue
        sizes = _row_sizes(cfg, module, p.shape[0])
        shapes = tuple((size, *p.shape[1:]) for size in sizes) if sizes else (p.shape,)
        out.append(Entry(p.name, names, shapes))
    return out


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
    head_dim = getattr(hf_config, "head_dim", None) or d // heads
    return ModelConfig(**llama.decoder_fields_from_hf(hf_config, family, name, rope),
                       head_width=0 if head_dim * heads == d else head_dim, mlp_bias=False, **fields)


def config_to_hf(cfg: ModelConfig, special: dict[str, int | None] | None = None):
    """The HF config of `cfg`'s family (hf_family)."""
    import transformers

    family = hf_family(cfg)
    config_class, architecture = FAMILIES[family]
    fields = llama.decoder_fields_to_hf(cfg, architecture, {"rope_type": "default", "rope_theta": cfg.rope_theta},
                                        special)
    fields["head_dim"] = cfg.head_dim
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
    return family_entries(hf_family(cfg), cfg)


FAMILY = Family(
    name="MoE / Qwen3", model_types=tuple(FAMILIES), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    exports=exports, entries=entries,
    tied_head=lambda cfg: ("lm_head.weight", llama.TOP_LEVEL["wte.weight"]) if cfg.tie_embeddings else None,
    ignored=llama._IGNORED_SUFFIXES,
    fp32_in_hf=True)  # RMSNorm and rotary as llama.py's families
