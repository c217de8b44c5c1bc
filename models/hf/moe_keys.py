"""Key map of the MoE and Qwen3 families: Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE / Qwen3 <-> megazoo, as the
`Entry` list the one converter streams (models/hf/family.py, converter.py).

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
the per-expert form back (checked by tests/models/moe/test_moe_hf.py), so the map reads and writes that form.
An expert entry stacks its experts' tensors (its own join) and unstacks them (its own split).
"""

from __future__ import annotations

import functools

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.hf import llama
from megazoo.models.hf.family import Entry
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


def _join_experts(n_experts: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    per_expert = len(tensors) // n_experts  # [gate_e; up_e] rows of expert e, or its lone down_e, stacked over e
    return torch.stack([torch.cat(tensors[e * per_expert:(e + 1) * per_expert]) for e in range(n_experts)])


def _split_experts(per_expert: int, tensor: torch.Tensor) -> list[torch.Tensor]:
    return [p.contiguous() for expert in tensor.unbind(0) for p in expert.chunk(per_expert)]


def entries(family: str, cfg: ModelConfig) -> list[Entry]:
    """Every megazoo parameter of `cfg` with the HF tensors of `family` it is made of (the module docstring)."""
    out = []
    for p in parameter_layout(cfg, vocab=cfg.vocab_size):
        names = tuple(hf_names(family, cfg, p.name))
        module = _split(p.name)[1] if p.name.startswith("h.") else ""
        if module in EXPERT_MODULES:
            per_expert = len(names) // cfg.n_experts
            rows = p.shape[1] // per_expert
            out.append(Entry(p.name, names, ((rows, p.shape[2]),) * len(names),
                             join_fn=functools.partial(_join_experts, cfg.n_experts),
                             split_fn=functools.partial(_split_experts, per_expert)))
            continue
        sizes = _row_sizes(cfg, module, p.shape[0])
        shapes = tuple((size, *p.shape[1:]) for size in sizes) if sizes else (p.shape,)
        out.append(Entry(p.name, names, shapes))
    return out
