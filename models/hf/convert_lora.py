"""`megazoo convert megazoo-to-hf` of a LoRA run's checkpoint: `--merge-lora` (adapters folded into the base:
a plain HF model) or `--peft-adapter` (the adapter alone in PEFT's format, models/lora/peft_interop.py).

A LoRA run's checkpoints hold only the adapters (recipes/training/lora_setup.py); the base is the checkpoint its
recipe loaded (`checkpoint.load`, recorded in the checkpoint's common.json), or `--lora-base`. The merged model is
written in the base's parameter dtype (or --dtype), sharded like every export (converter.py: write_hf_folder).

An SFT run's export (`chat_export`, for plain and merged exports alike) carries the chat template its dataset was
rendered with (the SFT dataset's manifest records it; the recipe's sft.path names the dataset) as
tokenizer_config.json's `chat_template`, so `apply_chat_template` works, and its end-of-turn marker as the stop:
when the marker is one token of the tokenizer it becomes the eos token (tokenizer_config.json, config.json and
generation_config.json, whose eos list keeps end-of-text too); when the tokenizer splits it into several tokens,
generation_config.json's `stop_strings` holds it (transformers' generate stops there given the tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

from megazoo.models.config import ModelConfig
from megazoo.models.lora.adapters import LoRAConfig
from megazoo.models.lora.checkpoint import lora_base, lora_of_common


def lora_of_checkpoint(common: dict) -> LoRAConfig | None:
    """The `[lora]` a checkpoint was trained with (its common.json's recipe), or None for full fine-tuning."""
    return lora_of_common(common)


def lora_checkpoint(checkpoint: str | Path) -> tuple[dict, LoRAConfig | None]:
    from megazoo.parallel.checkpoint.consolidate import read_common, resolve_checkpoint

    common = read_common(resolve_checkpoint(checkpoint, report=lambda *_: None))
    return common, lora_of_checkpoint(common)


def _full_state(checkpoint: str | Path) -> tuple[ModelConfig, dict]:
    """(ModelConfig, full fp32 state) of a checkpoint of any layout (parallel/checkpoint/consolidate.py)."""
    from megazoo.parallel.checkpoint.consolidate import read_full_state

    model, state = read_full_state(checkpoint)
    return ModelConfig(**model), state


def merged_reader(checkpoint: str | Path, base: str | Path | None = None):
    """(cfg, read(name) -> one merged full tensor, the base's names, the base's dtype) of a LoRA checkpoint: the
    adapters (small: rank r) are held, the base is read one tensor at a time (a megazoo checkpoint of any layout, or
    the HF folder a `model.from_hf` run read) and each weight merged as it is read (models/lora/adapters.py:
    merged_weight), so a merge streams like a conversion."""
    import torch

    from megazoo.models.lora.adapters import merged_weight
    from megazoo.parallel.checkpoint.consolidate import CheckpointReader, resolve_checkpoint

    common, lora = lora_checkpoint(checkpoint)
    if lora is None:
        raise ValueError(f"checkpoint {checkpoint} was not trained with LoRA (its recipe has no [lora] rank): "
                         "export it without --merge-lora / --peft-adapter")
    recorded = (common.get("recipe") or {}).get("checkpoint", {}).get("load")
    hf_base = ((common.get("recipe") or {}).get("model") or {}).get("from_hf")
    cfg, adapters = _full_state(checkpoint)
    if not base and not recorded and hf_base:  # the run read its base straight from an HF folder
        from megazoo.models.hf.families import read_hf_config
        from megazoo.models.hf.safetensors_files import DTYPES, HFWeights

        if not Path(hf_base).is_dir():
            raise ValueError(f"checkpoint {checkpoint}: the LoRA base its recipe recorded (model.from_hf = "
                             f"{hf_base!r}, relative to the folder the run started in) is not at "
                             f"{Path(hf_base).resolve()}; run from that folder or pass --lora-base CKPT")
        family, _, _ = read_hf_config(hf_base)
        weights = HFWeights(hf_base)
        entries = {e.ours: e for e in family.entries(cfg)}
        stored = weights.dtype(next(iter(entries.values())).hf[0])
        dtype = {v: k for k, v in DTYPES.items()}.get(stored) or getattr(torch, stored.removeprefix("torch."))

        def read_base(name: str) -> torch.Tensor:
            return entries[name].join([weights.read(n) for n in entries[name].hf])
        names = list(entries)
    else:  # --lora-base, else the recorded checkpoint.load resolved as the run resolved it (models/lora/checkpoint.py)
        base = lora_base(common, resolve_checkpoint(checkpoint, report=lambda *_: None), base)
        reader = CheckpointReader(base)
        base_cfg = ModelConfig(**reader.model)
        if base_cfg.n_layer != cfg.n_layer or base_cfg.d_model != cfg.d_model:
            raise ValueError(f"LoRA base {base} is model {base_cfg.name}, the adapters' is {cfg.name}")
        read_base, names, dtype = reader.read, [n for n in reader.names() if ".lora." not in n], reader.param_dtype()

    def read(name: str) -> torch.Tensor:
        return merged_weight(name, read_base(name), adapters, cfg, lora, in_place=True)  # a fresh read: no clone
    return cfg, read, names, dtype


def export_lora(checkpoint: str | Path, staging: Path, *, merge: bool, base: str | Path | None,
                tokenizer=None, dtype=None, max_shard_bytes: int | None = None):
    """Write the merged HF model (merge) or the PEFT adapter into `staging`; returns (cfg, what was written,
    (the merged weights as a lazily read mapping in the dtype written, that dtype) or None for an adapter)."""
    if not merge:
        from megazoo.models.lora.peft_interop import write_peft_adapter

        common, lora = lora_checkpoint(checkpoint)
        if lora is None:
            raise ValueError(f"checkpoint {checkpoint} was not trained with LoRA: it has no adapter to export")
        cfg, adapters = _full_state(checkpoint)
        write_peft_adapter(staging, adapters, cfg, lora)
        return cfg, "PEFT LoRA adapter", None
    from megazoo.models.hf.converter import LazyState, write_hf_folder
    from megazoo.models.hf.families import family_of_config
    from megazoo.models.hf.safetensors_files import DEFAULT_MAX_SHARD

    cfg, read, names, base_dtype = merged_reader(checkpoint, base)
    family = family_of_config(cfg)
    dtype = dtype or base_dtype  # merged in the base's dtype
    files = write_hf_folder(staging, family, cfg, read, dtype, tokenizer=tokenizer,
                            max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD)
    chat_export(staging, lora_checkpoint(checkpoint)[0], tokenizer)
    return (cfg, f"HF {family.exports(cfg)} directory (LoRA merged, {str(dtype).removeprefix('torch.')}, "
            f"{len(files)} safetensors file(s))", (LazyState(read, names, dtype), dtype))


def sft_template(common: dict) -> str | None:
    """The chat template an SFT run's dataset was rendered with (its manifest's "template"), or None."""
    from megazoo.data.sft.dataset import MANIFEST_SUFFIX

    path = ((common.get("recipe") or {}).get("sft") or {}).get("path")
    manifest = Path(str(path) + MANIFEST_SUFFIX) if path else None
    if manifest is None or not manifest.is_file():
        return None
    return json.loads(manifest.read_text()).get("template")


def chat_export(out_dir: Path, common: dict, tokenizer) -> str | None:
    """An SFT run's chat template and end-of-turn stop written into the exported folder (module docstring);
    returns the template's name, or None for a run that was not SFT (nothing written)."""
    from megazoo.data.sft.chat_template import chat_encoder, end_of_turn, resolve_template
    from megazoo.models.hf.tokenizer_export import jinja_template

    name = sft_template(common)
    if name is None or tokenizer is None:
        return None
    _, render = resolve_template(tokenizer, name)
    marker = end_of_turn(render)
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    if name != "tokenizer":  # a tokenizer's own template is saved with it already
        tok_config["chat_template"] = jinja_template(name)
    ids = chat_encoder(tokenizer)(marker)  # as training read it: a special token's text is that token
    generation_path, model_path = out_dir / "generation_config.json", out_dir / "config.json"
    generation, model = json.loads(generation_path.read_text()), json.loads(model_path.read_text())
    if len(ids) == 1:
        eod = model.get("eos_token_id")
        tok_config["eos_token"] = marker
        model["eos_token_id"] = ids[0]
        generation["eos_token_id"] = [ids[0]] + ([eod] if isinstance(eod, int) and eod != ids[0] else [])
    else:
        generation["stop_strings"] = [marker]
    for path, data in ((config_path, tok_config), (generation_path, generation), (model_path, model)):
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return name
