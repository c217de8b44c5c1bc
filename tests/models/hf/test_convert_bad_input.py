"""Bad input to `megazoo convert` (issue 39's Done-when): a sharded folder missing a shard (with or without its
index), an index naming a missing file, placing tensors in files that lack them or dropping a numbered shard, a
dtype megazoo cannot convert or HF files cannot store, a model_type no family converts, a DCP folder missing or
truncating a data file: each exits 2 with a message naming what is wrong and what is valid, and nothing appears at
--out (not even a staging folder beside it). A conversion that fails half-way leaves nothing either, and an
existing --out is replaced only with --overwrite, only once the new folder is complete."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megazoo.models.hf import converter
from megazoo.parallel.checkpoint import consolidate
from megazoo.recipes import cli


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("hf") / "tiny"
    model.save_pretrained(str(path), max_shard_size="20KB")
    assert len(list(path.glob("model-*.safetensors"))) >= 3
    return path


@pytest.fixture(scope="module")
def ckpt(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "ckpt"
    assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def dcp_dir(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp") / "dcp"
    assert cli.main(["convert", "megazoo-to-dcp", str(ckpt), "--out", str(out)]) == 0
    return out


def _refused(capsys, tmp_path, argv, *said):
    out = tmp_path / "out"
    assert cli.main(["convert", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert all(s in err for s in said), err
    assert not out.exists() and not list(tmp_path.glob(".out.*")), "something was written"


def _copy(hf_dir, tmp_path):
    return shutil.copytree(hf_dir, tmp_path / "source")


def _shards(folder):
    return sorted(folder.glob("model-*.safetensors"))


def test_sharded_folder_without_index_and_a_shard(hf_dir, tmp_path, capsys):
    source = _copy(hf_dir, tmp_path)
    (source / "model.safetensors.index.json").unlink()
    second = _shards(source)[1]
    second.unlink()
    _refused(capsys, tmp_path, ["hf-to-megazoo", str(source)], "but no model.safetensors.index.json",
             f"lacks {second.name}")


def test_index_naming_a_missing_file(hf_dir, tmp_path, capsys):
    source = _copy(hf_dir, tmp_path)
    last = _shards(source)[-1]
    last.unlink()
    _refused(capsys, tmp_path, ["hf-to-megazoo", str(source)], "names 1 file(s) that are not there", last.name)


def test_index_dropping_a_numbered_shard(hf_dir, tmp_path, capsys):
    source = _copy(hf_dir, tmp_path)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    dropped = _shards(source)[1].name
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != dropped}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(capsys, tmp_path, ["hf-to-megazoo", str(source)], "numbering implies", dropped)


def test_index_placing_a_tensor_in_the_wrong_file(hf_dir, tmp_path, capsys):
    source = _copy(hf_dir, tmp_path)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    first, second = _shards(source)[:2]
    name = next(k for k, v in index["weight_map"].items() if v == first.name)
    index["weight_map"][name] = second.name
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(capsys, tmp_path, ["hf-to-megazoo", str(source)], "in files that do not hold them",
             f"{name} -> {second.name}")


def test_a_dtype_megazoo_cannot_convert(hf_dir, tmp_path, capsys):
    source = _copy(hf_dir, tmp_path)
    shard = _shards(source)[0]
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _refused(capsys, tmp_path, ["hf-to-megazoo", str(source)], f"{name}: F8_E4M3", "valid: F64, F32, BF16, F16")


def test_model_type_no_family_converts(hf_dir, ckpt, dcp_dir, tmp_path, capsys):
    source = _copy(hf_dir, tmp_path)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    valid = "model_type 'bert' cannot be converted; valid: deepseek_v3, deepseek_v2, gpt2, llama"
    _refused(capsys, tmp_path, ["hf-to-megazoo", str(source)], valid)
    _refused(capsys, tmp_path, ["dcp-to-megazoo", str(dcp_dir), "--config", str(source)], valid)


def test_a_dtype_hf_files_cannot_store(ckpt, tmp_path, capsys, monkeypatch):
    _refused(capsys, tmp_path, ["megazoo-to-hf", str(ckpt), "--dtype", "fp8"], "--dtype 'fp8'",
             "valid: auto, fp32, bf16, fp16")
    monkeypatch.setattr(consolidate.CheckpointReader, "param_dtype", lambda self: torch.float8_e5m2)
    _refused(capsys, tmp_path, ["megazoo-to-hf", str(ckpt), "--tokenizer", "none"],
             "parameter dtype (--dtype auto) float8_e5m2 cannot be written", "valid: float64, float32, bfloat16")


def test_dcp_folder_missing_or_truncating_a_data_file(dcp_dir, tmp_path, capsys):
    source = shutil.copytree(dcp_dir, tmp_path / "dcp")
    data = sorted(source.glob("*.distcp"))[0]
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    _refused(capsys, tmp_path, ["dcp-to-megazoo", str(source)], "shorter than its .metadata says", data.name)
    data.unlink()
    _refused(capsys, tmp_path, ["dcp-to-megazoo", str(source)], "data file(s) that are not there", data.name)


def test_a_failure_half_way_leaves_nothing_and_overwrite_swaps_only_when_done(hf_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("an earlier result")
    _refused_existing = cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(out)])
    assert _refused_existing == 2 and "--overwrite" in capsys.readouterr().err
    real = converter.megazoo_tensors

    def broken(*args):  # the first tensors are written, then the read fails
        for k, item in enumerate(real(*args)):
            if k == 3:
                raise OSError("disk vanished")
            yield item

    monkeypatch.setattr(converter, "megazoo_tensors", broken)
    with pytest.raises(OSError, match="disk vanished"):
        cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(out), "--overwrite"])
    assert [p.name for p in out.iterdir()] == ["earlier.txt"] and len(list(tmp_path.iterdir())) == 1
    monkeypatch.setattr(converter, "megazoo_tensors", real)
    assert cli.main(["convert", "hf-to-megazoo", str(hf_dir), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "earlier.txt").exists() and consolidate.CheckpointReader(out).names()
    assert len(list(tmp_path.iterdir())) == 1  # neither the staging folder nor the old one is left beside it
