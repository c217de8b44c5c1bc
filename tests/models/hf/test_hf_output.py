"""HF output as HF tools expect it (issue 39): the checkpoint's dtype kept (bf16 in, bf16 out) or --dtype's, files
cut at --max-shard-size with model.safetensors.index.json, `dtype` in config.json, generation_config.json;
transformers loads the folder and --verify holds it to the checkpoint. Bad input (an unknown dtype or size, a
model_type no family converts, an index naming a missing file) is refused with exit 2 before anything is
written."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf_helpers import safetensors_state

from megazoo.recipes import cli

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("hf") / "tiny-bf16"
    model.save_pretrained(str(path), max_shard_size="100KB")  # sharded source: read shard by shard
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def ckpt(bf16_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "ckpt"
    assert cli.main(["convert", "hf-to-megazoo", str(bf16_dir), "--out", str(out), "--verify"]) == 0
    return out




def test_bf16_stays_bf16_sharded_with_index_and_loads(bf16_dir, ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["convert", "megazoo-to-hf", str(ckpt), "--out", str(out), "--verify", "--tokenizer", "none",
                     "--max-shard-size", "150KB"]) == 0
    assert "FAIL" not in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((out / f).stat().st_size <= 150_000 + 64 * 1024 for f in files)  # a lone larger tensor: own file
    ours, theirs = safetensors_state(out), safetensors_state(bf16_dir)
    assert set(ours) == set(theirs) and set(index["weight_map"]) == set(ours)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, theirs[n]) for n, t in ours.items())
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert (out / "generation_config.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert next(model.parameters()).dtype == torch.bfloat16


def test_dtype_option_writes_fp32(ckpt, bf16_dir, tmp_path):
    out = tmp_path / "out"
    assert cli.main(["convert", "megazoo-to-hf", str(ckpt), "--out", str(out), "--tokenizer", "none",
                     "--dtype", "fp32", "--verify"]) == 0
    ours, theirs = safetensors_state(out), safetensors_state(bf16_dir)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert all(t.dtype == torch.float32 and torch.equal(t, theirs[n].float()) for n, t in ours.items())


@pytest.mark.parametrize("flag, value, said", [("--dtype", "fp8", "--dtype 'fp8'"),
                                                ("--max-shard-size", "lots", "--max-shard-size 'lots'")])
def test_bad_export_options_are_refused_first(ckpt, tmp_path, capsys, flag, value, said):
    out = tmp_path / "out"
    assert cli.main(["convert", "megazoo-to-hf", str(ckpt), "--out", str(out), flag, value]) == 2
    assert said in capsys.readouterr().err and not out.exists()


def test_model_type_no_family_converts_is_refused(bf16_dir, tmp_path, capsys):
    source = tmp_path / "bert"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert cli.main(["convert", "hf-to-megazoo", str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model_type 'bert' cannot be converted; valid: deepseek_v3, deepseek_v2, gpt2, llama, qwen2, mistral" in err
    assert not (tmp_path / "out").exists()


def test_index_naming_a_missing_shard_is_refused(bf16_dir, tmp_path, capsys):
    import shutil

    source = tmp_path / "partial"
    shutil.copytree(bf16_dir, source)
    missing = sorted(source.glob("model-*.safetensors"))[-1]
    missing.unlink()
    assert cli.main(["convert", "hf-to-megazoo", str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "names 1 file(s) that are not there" in err and missing.name in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
