"""Streaming conversion (issue 39): both directions hold one tensor at a time, never the model. A Llama-style model
of ~80 MB whose largest tensor is 4 MB (20x smaller) is converted HF -> megazoo -> HF in a fresh process; its
peak resident memory above the baseline (VmHWM after resetting it through /proc/self/clear_refs, once every
module the conversion imports is loaded by a warm-up conversion) stays under a small multiple of the largest
tensor, and the written folder (files of at most 30 MB, by --max-shard-size) holds the source's tensors
bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from megazoo.models.hf.llama import config_from_hf, entries

MB = 2**20
LARGEST = 4 * MB  # the embedding, the head and each HF gate / up projection: 2048 x 512 fp32
BOUND = 6  # peak above baseline <= BOUND x the largest tensor (measured: see the notes / README table)


def _hf_folder(path, layers: int, hidden: int, vocab: int, ffn: int, shards: int):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    config.save_pretrained(str(path))
    gen = torch.Generator().manual_seed(0)
    tensors = [(n, s) for e in entries(config_from_hf(config)) for n, s in zip(e.hf, e.hf_shapes)]
    per = -(-len(tensors) // shards)
    weight_map = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: torch.randn(s, generator=gen) * 0.02 for n, s in tensors[k * per:(k + 1) * per]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(torch.Size(s).numel() * 4 for _, s in tensors)


PROBE = r"""
import gc, json, re, sys
from megazoo.recipes import cli

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

def measured(argv):
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    assert cli.main(argv) == 0
    return status("VmHWM") - base

tiny, warm, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
assert cli.main(["convert", "hf-to-megazoo", tiny, "--out", warm + "/w1"]) == 0  # warm-up: every lazy import
assert cli.main(["convert", "megazoo-to-hf", warm + "/w1", "--out", warm + "/w2", "--tokenizer", "none"]) == 0
print(measured(argv))
"""


def _peak(tiny, warm, argv) -> int:
    """Peak resident bytes above the baseline of `megazoo` argv, in a fresh process (each direction its own: memory
    freed by an earlier conversion would stay resident and hide a later one's growth)."""
    run = subprocess.run([sys.executable, "-c", PROBE, str(tiny), str(warm), *argv],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return int(run.stdout.strip().splitlines()[-1])


def test_conversion_peak_memory_is_a_few_tensors_not_the_model(tmp_path):
    tiny, big = tmp_path / "tiny", tmp_path / "big"
    tiny.mkdir(), big.mkdir()
    _hf_folder(tiny, layers=1, hidden=64, vocab=128, ffn=128, shards=2)
    total = _hf_folder(big, layers=8, hidden=512, vocab=2048, ffn=1024, shards=4)
    assert total > 18 * LARGEST
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    peaks = {"to_megazoo": _peak(tiny, tmp_path / "warm1", ["convert", "hf-to-megazoo", str(big), "--out", str(ckpt)]),
             "to_hf": _peak(tiny, tmp_path / "warm2", ["convert", "megazoo-to-hf", str(ckpt), "--out", str(back),
                                                        "--tokenizer", "none", "--max-shard-size", "30MB"])}
    print(f"model {total / MB:.0f} MB, largest tensor {LARGEST / MB:.0f} MB, peaks above baseline (MB): "
          f"{ {k: round(v / MB, 1) for k, v in peaks.items()} }")
    assert peaks["to_megazoo"] <= BOUND * LARGEST and peaks["to_hf"] <= BOUND * LARGEST, peaks
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= total // (30 * 10**6) + 1 and all(os.path.getsize(back / f) <= 30 * 10**6 for f in files)
    source = json.loads((big / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index["weight_map"]) == set(source)
    for name, file in index["weight_map"].items():
        with safe_open(str(back / file), "pt") as ours, safe_open(str(big / source[name]), "pt") as theirs:
            assert torch.equal(ours.get_tensor(name), theirs.get_tensor(name)), name
