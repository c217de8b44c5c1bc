"""One forward and backward of our model with LoRA adapters attached and loaded, as the PEFT parity tests hold it
(tests/models/lora/test_lora_peft.py, tests/models/deepseek/test_mla_lora.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazoo.models.hf.gpt2 import load_full_state_into
from megazoo.models.lora.adapters import attach_lora
from megazoo.models.transformer import GPT
from megazoo.parallel.tensor import gather_from_tp_region, gather_full, named_shards
from megazoo.parallel.topology import Topology


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))


def adapted_step(topo: Topology, cfg, base: dict, lora, adapters: dict, ids: torch.Tensor, vocab: int):
    """(full logits, {adapter name: full gradient}, names of frozen parameters that got a gradient, elements this
    rank trains) of `cfg` with `base` and `adapters` loaded, at `topo`'s tp."""
    model = GPT(cfg, topo)
    attach_lora(model, lora)
    load_full_state_into(model, {**base, **adapters})
    model.eval()
    logits = gather_from_tp_region(model(ids), topo.tp_group)[..., :vocab]
    next_token_loss(logits, ids).backward()
    specs = {name: (p, spec) for name, p, spec in named_shards(model)}
    grads = {name: gather_full(p.grad, spec, topo.tp_group) for name, (p, spec) in specs.items() if p.requires_grad}
    frozen_grads = [name for name, (p, _) in specs.items() if not p.requires_grad and p.grad is not None]
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return logits.detach(), grads, frozen_grads, trained
