"""Which Hugging Face family an HF folder holds, and reading it as megazoo weights: the one place `megazoo convert`,
`megazoo eval --hf` and `megazoo generate --hf` ask, so every command reads the same families the same way.

    config.json's model_type     key map                 HF class (transformers backend)
    gpt2                         models/hf/gpt2.py       GPT2LMHeadModel
    llama / qwen2 / mistral      models/hf/llama.py      LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM

A new family adds its key map beside these and one row to `_FAMILY_MODULES`.
"""

from __future__ import annotations

import json
from pathlib import Path

# model_type -> the key map holding that family's config_from_hf / hf_to_megazoo_state (`_key_map`)
_FAMILY_MODULES = {"gpt2": "gpt2", "llama": "llama", "qwen2": "llama", "mistral": "llama"}
READABLE = tuple(_FAMILY_MODULES)


def _key_map(name: str):
    # imported when used: `megazoo convert --help` and the eval input checks load no torch through here
    if name == "gpt2":
        from megazoo.models.hf import gpt2
        return gpt2
    from megazoo.models.hf import llama
    return llama


def hf_model_type(hf_dir: str | Path) -> str:
    """config.json's model_type ("gpt2", "llama", "qwen2", "mistral", ...), read without transformers."""
    config = Path(hf_dir) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"HF checkpoint directory {hf_dir} has no config.json")
    try:
        return str(json.loads(config.read_text())["model_type"])
    except (ValueError, KeyError) as error:
        raise ValueError(f"cannot read HF config {config} (its model_type): {error!r}") from error


def family_module(hf_dir: str | Path):
    """The key-map module of the folder's family; refuses a family megazoo does not read, naming the valid ones."""
    model_type = hf_model_type(hf_dir)
    if model_type not in _FAMILY_MODULES:
        raise ValueError(f"{hf_dir}: HF model_type {model_type!r} cannot be converted; valid: {', '.join(READABLE)}")
    return _key_map(_FAMILY_MODULES[model_type])


def read_hf_config(hf_dir: str | Path):
    """The ModelConfig of an HF folder of any readable family, named after the folder (weights not read)."""
    from transformers import AutoConfig

    module = family_module(hf_dir)
    hf_dir = Path(hf_dir)
    try:
        hf_config = AutoConfig.from_pretrained(str(hf_dir))
    except Exception as error:  # transformers raises OSError / ValueError / JSON errors for bad configs
        raise ValueError(f"cannot read HF config {hf_dir / 'config.json'}: {error}") from error
    return module.config_from_hf(hf_config, name=hf_dir.resolve().name)


def read_hf_dir(hf_dir: str | Path):
    """(ModelConfig, full megazoo state) of an HF folder of any readable family (config.json + weights)."""
    from megazoo.models.hf.gpt2 import read_hf_state_dict

    cfg = read_hf_config(hf_dir)
    return cfg, family_module(hf_dir).hf_to_megazoo_state(read_hf_state_dict(hf_dir), cfg)


def tokenizer_spec(hf_dir: str | Path) -> str:
    """The tokenizer an HF folder carries, as a tokenizer spec (data/tokenizers/loading.py): transformers' own
    (`hf:DIR`) where the folder ships one (tokenizer.json / tokenizer.model) and is not a GPT-2 BPE folder, as
    `megazoo convert hf-to-megazoo` records it; else the folder itself (GPT-2's vocab.json + merges.txt)."""
    hf_dir = Path(hf_dir)
    own = any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
    bpe = any((hf_dir / name).is_file() for name in ("vocab.json", "encoder.json"))
    if own and (hf_model_type(hf_dir) != "gpt2" or not bpe):
        return f"hf:{hf_dir.resolve()}"
    return str(hf_dir)


def load_hf_causal_lm(hf_dir: str | Path, device="cpu"):
    """transformers' own model of the folder (AutoModelForCausalLM: the family's *ForCausalLM class) in fp32 and
    eval mode, for `--backend transformers` cross-checks; the family is checked first, as for our backend."""
    import torch
    from transformers import AutoModelForCausalLM

    family_module(hf_dir)
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).to(device).eval()
