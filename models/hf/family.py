"""What a Hugging Face family is to the one converter (converter.py): a `Family`, i.e. a key map and two config
functions. Adding a family is one small module declaring its `FAMILY` and one line in families.py (the registry).

A family module (gpt2.py, llama.py, ...) declares `FAMILY = Family(...)` with:
  name          short name printed to the user ("GPT-2", "Llama")
  model_types   the config.json `model_type` values it reads ("llama", "qwen2", "mistral")
  config_from_hf(hf_config, name) -> ModelConfig
                refuses (ValueError naming the field and the value) what megazoo's decoder does not compute
  config_to_hf(cfg, special) -> transformers.PretrainedConfig
                `special`: bos / eos / pad ids of the tokenizer written beside the weights, or None
  exports(cfg) -> str | None
                the model_type `cfg` is written as, None when `cfg` is not this family's; raises ValueError when
                `cfg` is nearly but not exactly expressible (e.g. a Llama attention bias on q/k/v only)
  entries(cfg) -> list[Entry]
                every megazoo parameter (models/layout.py's order and names, embedding at the true vocabulary)
                with the HF tensors it is made of, in the order HF files list them
  written(cfg)  (optional) the entries an export writes where they are more than entries(cfg)'s: DeepSeek-V3's
                multi-token prediction layers repeat the shared embedding and head, which a reader leaves out
  tied_head(cfg) -> (hf head name, hf embedding name) | None
                a tied output head some HF files still carry: on reading it must equal the embedding (checked),
                on writing it is left out, as transformers' save_pretrained does
  ignored       suffixes of HF tensors that hold no weights (rotary_emb.inv_freq, GPT-2's causal-mask buffers)
  torchtitan    (optional) entries(cfg)'s counterpart in torchtitan's names, for its DCP checkpoints
  fp32_in_hf    transformers' implementation rounds to fp32 inside an fp64 model (RMSNorm, rotary): --verify then
                takes its tolerance from the model's fp32 floor (convert_verify.py)

An `Entry` says how one megazoo tensor is made of HF tensors and back, one tensor at a time (the converter
streams: it never holds more than one entry's tensors):
  ours = join([HF tensors in `hf` order]); [HF tensors] = split(ours)
The default join concatenates rows (dim 0; e.g. Llama's [gate_proj; up_proj] into our fused c_fc), or transposes
a lone tensor when `transpose` (GPT-2's Conv1D); the default split is its inverse by `hf_shapes`. A family whose
megazoo tensor is built otherwise (an MoE's experts stacked into one tensor, a fused projection interleaved per
head) passes its own `join` / `split`; `hf_shapes` must always be given, since the streaming writer lays out each
safetensors file's header before it has read any data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megazoo.models.config import ModelConfig


@dataclass(frozen=True)
class Entry:
    ours: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    transpose: bool = False  # a lone HF tensor stored (in, out): GPT-2's Conv1D
    join_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = field(default=None, compare=False)
    split_fn: Callable[[torch.Tensor], list[torch.Tensor]] | None = field(default=None, compare=False)
    # Stacked experts: our dim-0 index e is `stacked` consecutive HF tensors (hf[e*k:(e+1)*k], rows concatenated),
    # so a rank holding some experts reads only theirs (converter.read_local); 0: not stacked.
    stacked: int = 0

    def join(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Our tensor from the HF ones (in `hf` order)."""
        if self.join_fn is not None:
            return self.join_fn(tensors)
        if self.stacked:
            k = self.stacked
            return torch.stack([torch.cat(tensors[i:i + k]) for i in range(0, len(tensors), k)])
        if self.transpose:
            return tensors[0].t().contiguous()
        return torch.cat(tensors) if len(tensors) > 1 else tensors[0]

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The HF tensors (in `hf` order) from ours."""
        if self.split_fn is not None:
            return self.split_fn(tensor)
        if self.stacked:
            rows = [s[0] for s in self.hf_shapes[:self.stacked]]
            return [p.contiguous() for expert in tensor.unbind(0) for p in expert.split(rows)]
        if self.transpose:
            return [tensor.t().contiguous()]
        return [p.contiguous() for p in tensor.split([s[0] for s in self.hf_shapes])]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[..., ModelConfig]
    config_to_hf: Callable[..., object]
    exports: Callable[[ModelConfig], str | None]
    entries: Callable[[ModelConfig], list[Entry]]
    tied_head: Callable[[ModelConfig], tuple[str, str] | None]
    ignored: tuple[str, ...] = ()
    fp32_in_hf: bool = False
    torchtitan: Callable[[ModelConfig], list[Entry]] | None = None
    # Whether the HF format holds multi-token prediction modules (DeepSeek-V3's, as layers n_layer + k: see
    # models/deepseek/mtp_hf.py); the other families' folders leave them out (exported_config).
    mtp: bool = False
    written: Callable[[ModelConfig], list[Entry]] | None = None

    def written_entries(self, cfg: ModelConfig) -> list[Entry]:
        """The entries an export writes (module docstring: `written`)."""
        return (self.written or self.entries)(cfg)


def exported_config(family: Family, cfg: ModelConfig) -> ModelConfig:
    """`cfg` as `family`'s HF folder holds it. The MTP modules (models/deepseek/mtp.py) only add a training loss
    and a draft for speculative decoding: where the format has no place for them they are dropped on export
    (the logits are the main model's either way). Such a folder reads back as a model without them (mtp_depth 0;
    `model.from_hf` with mtp_depth set is refused as any architecture override is)."""
    return cfg if family.mtp or not cfg.mtp_depth else cfg.replace(mtp_depth=0)
