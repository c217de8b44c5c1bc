"""The registry of Hugging Face families megazoo converts (each declared in its own module: models/hf/family.py
says what a family provides), and what needs it: an HF folder's family and config, a megazoo config's family.
The one place `megazoo convert`, `megazoo eval --hf`, `megazoo generate --hf` and `model.from_hf` ask, so every
command reads the same families the same way.

Adding a family: its module (e.g. models/hf/mixtral.py declaring `FAMILY`) and one line in `families()`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when used: `megazoo convert --help` and the eval input checks load no torch here
    import torch

    from megazoo.models.config import ModelConfig
    from megazoo.models.hf.family import Family


def families() -> tuple[Family, ...]:
    """Every family, in the order a megazoo config is offered to them (the first whose `exports` claims it). Read
    at call time, so a test may replace a module's FAMILY."""
    from megazoo.models.deepseek import hf as deepseek
    from megazoo.models.hf import gpt2, llama, moe_families

    # deepseek first: it claims latent attention, which the Llama-style families would misread
    return (deepseek.FAMILY, gpt2.FAMILY, llama.FAMILY, moe_families.FAMILY)


def hf_model_type(hf_dir: str | Path) -> str:
    """config.json's model_type ("gpt2", "llama", "qwen2", "mistral", ...), read without transformers or torch."""
    config = Path(hf_dir) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"HF checkpoint directory {hf_dir} has no config.json")
    try:
        return str(json.loads(config.read_text())["model_type"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"cannot read HF config {config} (its model_type): {error!r}") from error


def model_types() -> list[str]:
    return [t for family in families() for t in family.model_types]


def family_of_model_type(model_type: str, where: str = "HF directory") -> Family:
    """The family that reads config.json's `model_type`; a clear error listing the valid ones otherwise."""
    for family in families():
        if model_type in family.model_types:
            return family
    raise ValueError(f"{where}: HF model_type {model_type!r} cannot be converted; valid: {', '.join(model_types())}")


def family_of_config(cfg: ModelConfig) -> Family:
    """The family that writes `cfg` (its `exports` names a model_type); raises what a near miss says."""
    for family in families():
        if family.exports(cfg) is not None:
            return family
    raise ValueError(f"model {cfg.name} (norm={cfg.norm!r}, positions={cfg.positions!r}, mlp={cfg.mlp!r}) is "
                     f"not computed by any Hugging Face family megazoo writes ({', '.join(model_types())})")


def read_hf_config(hf_dir: str | Path) -> tuple[Family, ModelConfig, object]:
    """(family, ModelConfig, transformers config) of an HF folder's config.json (no weights read)."""
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    config = hf_dir / "config.json"
    family = family_of_model_type(hf_model_type(hf_dir), str(hf_dir))
    try:
        hf_config = AutoConfig.from_pretrained(str(hf_dir))
    except Exception as error:  # transformers raises OSError / ValueError / JSON errors for bad configs
        raise ValueError(f"cannot read HF config {config}: {error}") from error
    cfg = family.config_from_hf(hf_config, name=hf_dir.resolve().name)
    if family.mtp:  # multi-token prediction modules: those the folder's weights hold (models/deepseek/mtp_hf.py)
        from megazoo.models.deepseek.mtp_hf import held_depth

        declared = getattr(hf_config, "num_nextn_predict_layers", 0) or 0
        cfg = cfg.replace(mtp_depth=held_depth(hf_dir, cfg.n_layer, declared))
    return family, cfg, hf_config


def read_hf_dir(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, full megazoo state) of an HF folder of any family (every tensor in memory: for evaluation
    and tests; conversion streams)."""
    family, cfg, _ = read_hf_config(hf_dir)
    from megazoo.models.hf.converter import megazoo_tensors
    from megazoo.models.hf.safetensors_files import HFWeights

    return cfg, dict(megazoo_tensors(HFWeights(hf_dir), family, cfg))


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

    family_of_model_type(hf_model_type(hf_dir), str(hf_dir))
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).to(device).eval()
