"""Key maps of the MoE and Qwen3 families: Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE / Qwen3 <-> megazoo.

Attention, norms, embedding, head and dense MLPs follow models/hf/llama.py's map (Qwen3 adds the per-head norms
self_attn.q_norm / k_norm <-> attn.q_norm / k_norm). What is new is the MoE block (under model.layers.<i>.):

    ours                        HF checkpoint (hub files)                       transformers 5 in memory
    mlp.router.weight           mixtral: block_sparse_moe.gate.weight            mlp.gate.weight
                                qwen*_moe: mlp.gate.weight                       mlp.gate.weight
    mlp.experts.c_fc.weight     per expert e, rows [gate; up]:                   mlp.experts.gate_up_proj
      (E, 2 f, d)               mixtral: block_sparse_moe.experts.<e>.w1 ; w3   (E, 2 f, d), the same
                                qwen*_moe: mlp.experts.<e>.gate_proj ; up_proj
    mlp.experts.c_proj.weight   mixtral: block_sparse_moe.experts.<e>.w2         mlp.experts.down_proj
      (E, d, f)                 qwen*_moe: mlp.experts.<e>.down_proj             (E, d, f), the same
    mlp.shared.c_fc             qwen2_moe: [mlp.shared_expert.gate_proj; up_proj]
    mlp.shared.c_proj           qwen2_moe: mlp.shared_expert.down_proj
    mlp.shared_gate.weight      qwen2_moe: mlp.shared_expert_gate.weight

Import takes either form (a hub directory, or a live transformers model's state_dict); export writes the hub
form, which every transformers version loads (version 5 fuses it on load). Everything here is data and small
functions, so a streaming converter can take it per tensor.
"""

from __future__ import annotations

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.hf import llama

# The HF module prefix of the MoE block in the hub files, and the names of one expert's three matrices.
MOE_PREFIX = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp", "qwen3_moe": "mlp"}
EXPERT_MATRICES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                   "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
# Non-expert modules of the MoE block: ours -> HF's (under model.layers.<i>.), as llama.BLOCK_MODULES.
SHARED_MODULES = {"mlp.shared.c_fc": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                  "mlp.shared.c_proj": ("mlp.shared_expert.down_proj",),
                  "mlp.shared_gate": ("mlp.shared_expert_gate",)}
QK_NORM_MODULES = {"attn.q_norm": ("self_attn.q_norm",), "attn.k_norm": ("self_attn.k_norm",)}
FUSED = {"mlp.experts.c_fc.weight": "mlp.experts.gate_up_proj", "mlp.experts.c_proj.weight": "mlp.experts.down_proj"}


def _split(name: str) -> tuple[str, str, str]:
    _, index, rest = name.split(".", 2)  # h.<i>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return index, module, kind


def hf_names(family: str, cfg: ModelConfig, name: str) -> list[str]:
    """The hub tensor names whose rows make our parameter `name` (stacked experts: expert by expert, gate before up)."""
    if name in llama.TOP_LEVEL:
        return [llama.TOP_LEVEL[name]]
    index, module, kind = _split(name)
    layer = f"model.layers.{index}."
    if module == "mlp.router":
        return [f"{layer}{MOE_PREFIX[family]}.gate.{kind}"]
    if module in ("mlp.experts.c_fc", "mlp.experts.c_proj"):
        gate, up, down = EXPERT_MATRICES[family]
        mats = (gate, up) if module.endswith("c_fc") else (down,)
        return [f"{layer}{MOE_PREFIX[family]}.experts.{e}.{m}.{kind}" for e in range(cfg.n_experts) for m in mats]
    modules = SHARED_MODULES.get(module) or QK_NORM_MODULES.get(module) or llama.BLOCK_MODULES[module]
    return [f"{layer}{hf}.{kind}" for hf in modules]


def fused_name(name: str) -> str | None:
    """transformers 5's in-memory name of our stacked expert parameter (None for everything else)."""
    index, module, kind = _split(name) if name.startswith("h.") else ("", "", "")
    key = f"{module}.{kind}"
    return f"model.layers.{index}.{FUSED[key]}" if key in FUSED else None


def to_megazoo(family: str, cfg: ModelConfig, name: str, shape: tuple[int, ...],
               hf_state: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, list[str]]:
    """(our tensor or None when absent, the HF names it used) for parameter `name`."""
    fused = fused_name(name)
    if fused is not None and fused in hf_state:
        return hf_state[fused], [fused]
    names = hf_names(family, cfg, name)
    if family == "mixtral" and names[0] not in hf_state and ".block_sparse_moe." in names[0]:
        names = [n.replace(".block_sparse_moe.", ".mlp.") for n in names]  # transformers 5's router name
    if any(n not in hf_state for n in names):
        return None, [n for n in names if n not in hf_state]
    tensors = [hf_state[n] for n in names]
    if fused is not None:  # per-expert hub tensors: [gate_e; up_e] rows of expert e, stacked over e
        per_expert = len(tensors) // cfg.n_experts
        return torch.stack([torch.cat(tensors[e * per_expert:(e + 1) * per_expert])
                            for e in range(cfg.n_experts)]), names
    return (torch.cat(tensors) if len(tensors) > 1 else tensors[0]), names


def to_hf(family: str, cfg: ModelConfig, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The hub tensors of our parameter `name`."""
    names = hf_names(family, cfg, name)
    if fused_name(name) is not None:
        pieces = [p for expert in tensor.unbind(0) for p in
                  (expert.chunk(2) if name.endswith("experts.c_fc.weight") else (expert,))]
    elif len(names) > 1:
        pieces = tensor.chunk(len(names))  # [gate; up] of the shared SwiGLU, [k; v]: equal row blocks
        pieces = tensor.split(llama.split_sizes(cfg, name)) if llama.split_sizes(cfg, name) else pieces
    else:
        pieces = [tensor]
    return {n: p.contiguous() for n, p in zip(names, pieces, strict=True)}
