"""Multi-token prediction modules in Hugging Face files, as DeepSeek-V3's checkpoints store them.

DeepSeek-V3's HF folder (num_nextn_predict_layers = D in config.json) holds depth k's module as one more decoder
layer, index n_layer + k - 1 (model.layers.61 for the 61-layer V3): the layer's own tensors under the decoder
layer's names (input_layernorm, self_attn.*, post_attention_layernorm, mlp.*), beside `enorm`, `hnorm`,
`eh_proj` and `shared_head.norm`; it also repeats the shared `embed_tokens` and `shared_head.head` (copies of
model.embed_tokens and lm_head). transformers' DeepseekV3ForCausalLM ignores that layer on loading (its
_keys_to_ignore_on_load_unexpected), so a folder that holds it still loads and computes the main model.

megazoo keeps the modules where the family's format has this place (Family.mtp, set by the DeepSeek key map):
`mtp_entries` extends a family's key map with them, our block's names following the family's own for layer
n_layer + k - 1, and writes the two shared copies so vLLM / SGLang's MTP loaders find them (on reading they are
checked equal to the main ones, `shared_copies`). Every other family's folder leaves the modules out
(models/hf/family.py: exported_config).
"""

from __future__ import annotations

from typing import Callable

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.hf.family import Entry

# DeepSeek-V3's names for our per-depth tensors, under model.layers.{n_layer + k - 1}.
OWN = {"hnorm.weight": "hnorm.weight", "enorm.weight": "enorm.weight", "eh_proj.weight": "eh_proj.weight",
       "norm.weight": "shared_head.norm.weight"}


def mtp_entries(cfg: ModelConfig, family_entries: Callable[[ModelConfig], list[Entry]], *,
                copies: bool = False) -> list[Entry]:
    """Entries for `cfg`'s MTP modules (none when mtp_depth = 0): each block's from `family_entries` of the same
    model with n_layer + mtp_depth decoder layers (its layer n_layer + k - 1 renamed to our mtp.layers.{k-1}.block),
    then the depth's own tensors. `copies` (writing): also each layer's copies of the shared embedding and head,
    made from our wte / lm_head (a reader leaves them out and checks them: check_shared_copies)."""
    if not cfg.mtp_depth:
        return []
    deeper = family_entries(cfg.replace(n_layer=cfg.n_layer + cfg.mtp_depth, mtp_depth=0))
    main = {e.ours: e for e in deeper if e.ours in ("wte.weight", "lm_head.weight")}
    d, out = cfg.d_model, []
    for k in range(cfg.mtp_depth):
        index, ours = cfg.n_layer + k, f"mtp.layers.{k}."
        layer = f"model.layers.{index}."
        out += [Entry(ours + name, (layer + OWN[name],), ((d, 2 * d) if name == "eh_proj.weight" else (d,),))
                for name in ("hnorm.weight", "enorm.weight", "eh_proj.weight")]
        out += [Entry(ours + "block." + e.ours[len(f"h.{index}."):], e.hf, e.hf_shapes, e.transpose, e.join_fn,
                      e.split_fn, e.stacked) for e in deeper if e.ours.startswith(f"h.{index}.")]
        out.append(Entry(ours + "norm.weight", (layer + OWN["norm.weight"],), ((d,),)))
        if copies:
            head = "wte.weight" if cfg.tie_embeddings else "lm_head.weight"
            out += [Entry("wte.weight", (layer + "embed_tokens.weight",), main["wte.weight"].hf_shapes),
                    Entry(head, (layer + "shared_head.head.weight",), main["wte.weight"].hf_shapes)]
    return out


def held_depth(hf_dir, n_layer: int, declared: int) -> int:
    """The MTP depths an HF folder holds: of the `declared` ones (config.json's num_nextn_predict_layers), those
    whose layer n_layer + k - 1 its weights hold (that layer's eh_proj), counted from the first. A folder that
    transformers' save_pretrained wrote declares 1 (DeepseekV3Config's default) and holds none: it reads as
    mtp_depth 0. No weight files: 0 (reading the weights then says what is missing)."""
    from megazoo.models.hf.safetensors_files import HFWeights

    if not declared:
        return 0
    try:
        names = set(HFWeights(hf_dir).names())
    except FileNotFoundError:
        return 0
    depth = 0
    while depth < declared and f"model.layers.{n_layer + depth}.{OWN['eh_proj.weight']}" in names:
        depth += 1
    return depth


def shared_copies(cfg: ModelConfig, embedding: str, head: str) -> list[tuple[str, str]]:
    """(HF copy name, the main tensor's HF name) of the shared embedding and head each MTP layer repeats."""
    return [(f"model.layers.{cfg.n_layer + k}.{copy}", main) for k in range(cfg.mtp_depth)
            for copy, main in (("embed_tokens.weight", embedding), ("shared_head.head.weight", head))]


def check_shared_copies(read: Callable[[str], torch.Tensor], cfg: ModelConfig, embedding: str, head: str,
                        present: set[str] | None = None) -> None:
    """On reading: each layer's copies equal the main embedding and head (ours shares one of each). `present`:
    the folder's tensor names, when a folder may leave the copies out (its readers take the main ones)."""
    for copy, main in shared_copies(cfg, embedding, head):
        if present is not None and copy not in present:
            continue
        if not torch.equal(read(copy), read(main)):
            raise ValueError(f"{copy} differs from {main}: megazoo's MTP modules share the main model's embedding "
                             "and head, so it cannot hold this checkpoint")
