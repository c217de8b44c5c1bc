"""LoRA adapters <-> Hugging Face PEFT's on-disk format (adapter_config.json + adapter_model.safetensors).

PEFT puts one adapter on each HF module it targets; ours sit on our (possibly fused) layers, one per target
(models/lora/adapters.py). The targets map one-to-one onto HF modules:

    target   HF GPT-2 (transformer.h.<i>.)   HF Llama family (model.layers.<i>.)
    qkv      attn.c_attn                     -
    q/k/v    -                               self_attn.q_proj / k_proj / v_proj
    o        attn.c_proj                     self_attn.o_proj
    gate     -                               mlp.gate_proj
    up       mlp.c_fc                        mlp.up_proj
    down     mlp.c_proj                      mlp.down_proj

HF DeepSeek-V3 / Kimi K2 (latent attention, model.layers.<i>.): q -> self_attn.q_b_proj (q_proj without q
compression), kv -> self_attn.kv_b_proj, o -> self_attn.o_proj. DeepSeek's checkpoints rotate interleaved rotary
dims and ours halves (models/deepseek/hf.py permutes q_b's rotary rows per head): q's lora_B rows get the same
permutation, so B A changes the HF weight exactly as ours.

PEFT's lora_A.weight is (r, in) and lora_B.weight (out, r) for nn.Linear and for GPT-2's Conv1D alike (only the
base Conv1D weight is transposed, `fan_in_fan_out`), which are our full lora_A / lora_B: nothing is transposed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.lora.adapters import TARGETS, LoRAConfig, adapter_layers

GPT2_MODULES = {"qkv": "attn.c_attn", "o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}
LLAMA_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
PEFT_PREFIX = "base_model.model."


def _is_llama(cfg: ModelConfig) -> bool:
    return cfg.mlp == "swiglu"  # models/hf/llama.py exports SwiGLU models; GPT-2's layout the others


def _modules(cfg: ModelConfig) -> tuple[dict[str, str], str]:
    if cfg.mla:
        q = "self_attn.q_b_proj" if cfg.q_lora_rank else "self_attn.q_proj"
        mlp = {t: m for t, m in LLAMA_MODULES.items() if t in ("gate", "up", "down")}
        return {"q": q, "kv": "self_attn.kv_b_proj", "o": "self_attn.o_proj", **mlp}, "model.layers."
    return (LLAMA_MODULES, "model.layers.") if _is_llama(cfg) else (GPT2_MODULES, "transformer.h.")


def _rope_rows(cfg: ModelConfig, target: str, kind: str, tensor: torch.Tensor, to_hf: bool) -> torch.Tensor:
    """q's lora_B on latent attention: its rotary rows in HF's interleaved order (to_hf) or back in ours."""
    if not (cfg.mla and target == "q" and kind == "lora_B"):
        return tensor
    from megazoo.models.deepseek.hf import _permute_rope
    return _permute_rope(cfg, cfg.n_head, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, to_hf, tensor)


def hf_module(cfg: ModelConfig, target: str) -> str:
    modules, _ = _modules(cfg)
    if target not in modules:
        family = "DeepSeek-V3" if cfg.mla else "Llama" if _is_llama(cfg) else "GPT-2"
        raise ValueError(f"lora target {target!r} has no module in HF {family} (PEFT adapts whole modules); "
                         f"valid there: {sorted(modules)}")
    return modules[target]


def peft_config(cfg: ModelConfig, lora: LoRAConfig) -> dict:
    """PEFT's adapter_config.json for `lora` on `cfg`'s HF model (target modules by their paths inside a block)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": [hf_module(cfg, t) for t in lora.targets],
            "fan_in_fan_out": not (_is_llama(cfg) or cfg.mla), "bias": "none", "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": None}


def key_pairs(cfg: ModelConfig, lora: LoRAConfig) -> list[tuple[str, str]]:
    """(our full name, PEFT key) of every adapter tensor."""
    return [(ours, key) for ours, key, _, _ in _keys(cfg, lora)]


def _keys(cfg: ModelConfig, lora: LoRAConfig) -> list[tuple[str, str, str, str]]:
    _, prefix = _modules(cfg)
    return [(f"h.{i}.{path}.lora.{target}.{kind}", f"{PEFT_PREFIX}{prefix}{i}.{hf_module(cfg, target)}.{kind}.weight",
             target, kind)
            for i in range(cfg.n_layer) for target, (path, _) in adapter_layers(cfg, lora).items()
            for kind in ("lora_A", "lora_B")]


def to_peft_state(full_state: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """{PEFT key: tensor} (as adapter_model.safetensors holds) from our full state's adapter tensors."""
    return {key: _rope_rows(cfg, target, kind, full_state[ours], True).contiguous()
            for ours, key, target, kind in _keys(cfg, lora)}


def from_peft_config(config: dict, cfg: ModelConfig) -> LoRAConfig:
    """Our `[lora]` settings from PEFT's adapter_config.json (the features we do not have are refused)."""
    for key, off in (("use_rslora", False), ("use_dora", False), ("bias", "none")):
        if config.get(key, off) != off:
            raise ValueError(f"PEFT adapter_config {key} = {config[key]!r} is not supported; valid: {off!r}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"PEFT adapter_config peft_type = {config['peft_type']!r}; valid: 'LORA'")
    modules, _ = _modules(cfg)
    by_module = {m: t for t, m in modules.items()}
    named = config["target_modules"]
    named = [named] if isinstance(named, str) else named
    targets = []
    for name in named:
        found = [t for m, t in by_module.items() if m == name or m.endswith("." + name)]
        if not found:
            raise ValueError(f"PEFT target module {name!r} is not one of {sorted(by_module)}")
        targets += [t for t in found if t not in targets]
    return LoRAConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                      dropout=float(config.get("lora_dropout", 0.0)),
                      targets=tuple(sorted(targets, key=TARGETS.index)))  # PEFT's order is a set's


def from_peft_state(peft_state: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """Our adapter tensors {h.<i>.<layer>.lora.<target>.lora_A/B: full tensor} from PEFT's (adapter name
    segments such as `.default.` tolerated, as in a live PeftModel's state_dict)."""
    cleaned = {k.replace(".default.", "."): v for k, v in peft_state.items()}
    keys = _keys(cfg, lora)
    missing = [key for _, key, _, _ in keys if key not in cleaned]
    if missing:
        raise ValueError(f"PEFT adapter lacks {len(missing)} tensor(s), e.g. {missing[:4]}")
    return {ours: _rope_rows(cfg, target, kind, cleaned[key], False) for ours, key, target, kind in keys}


def write_peft_adapter(out_dir: str | Path, full_state: dict[str, torch.Tensor], cfg: ModelConfig,
                       lora: LoRAConfig) -> Path:
    """Write the adapter alone in PEFT's format: `peft.PeftModel.from_pretrained(hf_model, out_dir)` loads it."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(peft_config(cfg, lora), indent=2) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in to_peft_state(full_state, cfg, lora).items()},
              str(out / "adapter_model.safetensors"))
    return out


def read_peft_adapter(adapter_dir: str | Path, cfg: ModelConfig) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """(our `[lora]` settings, our full adapter tensors) from a PEFT adapter folder."""
    from safetensors.torch import load_file
    folder = Path(adapter_dir)
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for path in (config_file, weights):
        if not path.is_file():
            raise ValueError(f"PEFT adapter folder {folder} lacks {path.name}")
    lora = from_peft_config(json.loads(config_file.read_text()), cfg)
    return lora, from_peft_state(load_file(str(weights)), cfg, lora)
