"""`model.from_hf = DIR` (issue 39): every rank reads only its own tp / pp / ZeRO-3 slices straight from the HF
safetensors files, no conversion step. At tp 2 x pp 2, at dp 2 x tp 2 under ZeRO-3 (4 gloo ranks) and at
tp 2 x pp 2 x ZeRO-1 dp 2 (8 ranks; megazoo refuses ZeRO-3 with pp > 1), the bytes each rank's reader counts are its share (the elements of its own
parameter views, in the file's dtype) to within 5%, and one training step's loss, gradient norm and resulting parameters equal the converted path's
(`megazoo convert hf-to-megazoo`, then checkpoint.load) exactly. Bad folders are refused by resolve()."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import transformers
from harness import run_distributed
from recipe_helpers import TINY

from megazoo.models.hf.families import family_of_config  # noqa: F401 (imported here: the ranks fork with it)
from megazoo.parallel.topology import Topology
from megazoo.recipes import cli
from megazoo.recipes.config import Recipe, RecipeError, from_dict
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.trainer import Trainer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.1))
    root = tmp_path_factory.mktemp("from-hf")
    model.save_pretrained(str(root / "hf"), max_shard_size="100KB")
    assert cli.main(["convert", "hf-to-megazoo", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
    return root


def _recipe(model: dict, parallel: dict, zero: dict, load: str = ""):
    table = copy.deepcopy(TINY)
    table["model"] = {"preset": "llama-tiny", "dropout": 0.0, "attn_dropout": 0.0, **model}
    table["parallel"].update(parallel)
    table["zero"] = zero
    table["train"].update(steps=1, warmup_steps=0, micro_batch=2, grad_accum=2)
    table["checkpoint"].update(load=load, load_optimizer=False)
    return resolve(from_dict(Recipe, table))


def _real(view, vocab: int) -> int:
    """Elements of a view that the HF files hold: all, but for the padded vocabulary's rows (zeros, not read)."""
    if view.name not in ("wte.weight", "lm_head.weight"):
        return view.stop - view.start
    first = view.spec.ranges()[0][0] if view.spec.dim == 0 else 0  # the global row of local row 0
    row = view.spec.global_shape[1]
    return max(0, min(view.stop, (vocab - first) * row) - view.start)


def _step(res):
    messages = []
    trainer = Trainer(res, Topology.of(res.recipe.parallel))
    views = checkpointing.state_views(trainer)
    share = {(v.name, v.spec, v.start, v.stop): _real(v, res.model.vocab_size) for v in views
             if v.kind in ("param", "master")}
    start = checkpointing.restore(trainer, report=messages.append)
    result = trainer.fit(start_step=start)
    read = [int(m.replace(",", "")) for text in messages for m in re.findall(r"\(([\d,]+) bytes read", text)]
    return {"loss": result.losses, "norm": result.grad_norms, "params": trainer.full_state_dict(),
            "read": read[0] if read else None, "share": 4 * sum(share.values())}  # the HF files hold fp32


def _both(hf: str, ckpt: str, parallel: dict, zero: dict):
    direct = _step(_recipe({"from_hf": hf}, parallel, zero))
    converted = _step(_recipe({"from_checkpoint": True}, parallel, zero, load=ckpt))
    return direct, converted


@pytest.mark.parametrize("parallel, zero", [({"tp": 2, "pp": 2, "schedule": "1f1b"}, {"stage": 0}),
                                            ({"dp": 2, "tp": 2}, {"stage": 3}),
                                            ({"dp": 2, "tp": 2, "pp": 2, "schedule": "1f1b"}, {"stage": 1})])
def test_each_rank_reads_its_share_and_trains_as_the_converted_path(folders, parallel, zero):
    world = parallel.get("dp", 1) * parallel["tp"] * parallel.get("pp", 1)
    results = run_distributed(_both, world, str(folders / "hf"), str(folders / "ckpt"), parallel, zero)
    for rank, (direct, converted) in enumerate(results):
        assert direct["share"] <= direct["read"] <= 1.05 * direct["share"], (rank, direct["read"], direct["share"])
        assert direct["loss"] == converted["loss"] and direct["norm"] == converted["norm"]
        for name, value in converted["params"].items():
            assert torch.equal(direct["params"][name], value), name
    shares = [direct["share"] for direct, _ in results]
    total = sum(t.numel() * 4 for t in results[0][1]["params"].values())
    assert max(shares) < 0.6 * total  # no rank reads the model: each about an eighth to a half of it


def test_bad_from_hf_is_refused_before_any_process(folders, tmp_path):
    with pytest.raises(RecipeError, match="model.from_hf = .*has no config.json"):
        _recipe({"from_hf": str(tmp_path)}, {}, {})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(RecipeError, match="model_type 'bert' cannot be converted; valid: deepseek_v3, deepseek_v2, gpt2, llama"):
        _recipe({"from_hf": str(tmp_path)}, {}, {})
    with pytest.raises(RecipeError, match="and so does checkpoint.load"):
        _recipe({"from_hf": str(folders / "hf")}, {}, {}, load=str(folders / "ckpt"))


def test_lora_base_from_hf_trains_and_exports_merged(folders, tmp_path, capsys):
    """LoRA with model.from_hf: the frozen base is read from the HF folder (it equals the converted weights), and
    `--merge-lora --verify` finds that base through the recipe the checkpoint recorded."""
    table = copy.deepcopy(TINY)
    table["model"] = {"preset": "llama-tiny", "dropout": 0.0, "attn_dropout": 0.0, "from_hf": str(folders / "hf")}
    table["train"].update(steps=2, warmup_steps=0, lr=3e-2)
    table["lora"] = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "down"]}
    table["checkpoint"].update(at_end=True)
    table["run"] = {"dir": str(tmp_path / "run")}
    res = resolve(from_dict(Recipe, table))
    trainer = Trainer(res, Topology.solo())
    messages = []
    checkpointing.restore(trainer, report=messages.append)
    assert any("LoRA base weights from the HF folder" in m for m in messages)
    base = {k: v for k, v in trainer.full_state_dict().items() if ".lora." not in k}
    from megazoo.models.hf.families import read_hf_dir

    _, converted = read_hf_dir(folders / "hf")
    assert all(torch.equal(base[k], converted[k].to(base[k].dtype)) for k in converted)
    trainer.fit()
    out = tmp_path / "merged"
    assert cli.main(["convert", "megazoo-to-hf", str(tmp_path / "run" / "checkpoints"), "--out", str(out),
                     "--merge-lora", "--verify", "--tokenizer", "none"]) == 0
    assert "FAIL" not in capsys.readouterr().out and (out / "config.json").is_file()
