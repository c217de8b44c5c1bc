"""LoRA on an MoE model's attention, exported: the real Trainer (fp64) fine-tunes q/k/v/o adapters of a tiny
Qwen3-MoE from a base checkpoint; `megazoo convert megazoo-to-hf --merge-lora` writes a Qwen3MoeForCausalLM whose
logits equal ours, and `--peft-adapter` an adapter that PEFT loads onto the exported base with the same logits."""

from __future__ import annotations

import dataclasses

import peft
import torch
import transformers
from recipe_helpers import tiny_recipe

from megazoo.models.hf.converter import write_hf_folder
from megazoo.models.hf.families import family_of_config
from megazoo.models.transformer import GPT
from megazoo.models.weights import full_state_dict, init_weights
from megazoo.parallel.checkpoint.consolidate import write_full_checkpoint
from megazoo.parallel.topology import Topology
from megazoo.recipes import cli
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.trainer import Trainer

V = 300
MODEL = {"preset": "qwen3-moe-tiny", "n_layer": 2, "vocab_size": V, "moe_dense_layers": [1]}
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "k", "v", "o"]}
IDS = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(11))


def _hf(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                             experts_implementation="eager").eval()


def test_lora_on_moe_attention_exports_merged_and_as_peft(tmp_path):
    res = resolve(tiny_recipe(model=MODEL))
    base = GPT(res.model, Topology.solo(), dtype=torch.float64)
    init_weights(base, seed=99)
    state = full_state_dict(base)
    write_full_checkpoint(state, dataclasses.asdict(res.model), tmp_path / "base")
    write_hf_folder(tmp_path / "hf-base", family_of_config(res.model), res.model, state.__getitem__, torch.float64)
    res = resolve(tiny_recipe(model=MODEL, train={"steps": 2, "warmup_steps": 1, "lr": 3e-2}, lora=LORA,
                              run={"dir": str(tmp_path / "run")},
                              checkpoint={"load": str(tmp_path / "base"), "at_end": True}))
    trainer = Trainer(res, Topology.solo())
    checkpointing.restore(trainer, report=lambda *_: None)
    trainer.fit()
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.model(IDS)[..., :V].float()
    checkpoints = str(tmp_path / "run" / "checkpoints")
    assert cli.main(["convert", "megazoo-to-hf", checkpoints, "--merge-lora", "--out", str(tmp_path / "merged")]) == 0
    merged = _hf(tmp_path / "merged")
    assert type(merged) is transformers.Qwen3MoeForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits.float(), ours, rtol=0, atol=1e-5)
        assert (_hf(tmp_path / "hf-base")(IDS).logits - ours).abs().max() > 1e-3  # the adapters matter
    assert cli.main(["convert", "megazoo-to-hf", checkpoints, "--peft-adapter", "--out", str(tmp_path / "adapter")]) == 0
    model = peft.PeftModel.from_pretrained(_hf(tmp_path / "hf-base"), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits.float(), ours, rtol=0, atol=1e-5)
