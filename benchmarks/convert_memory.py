"""Giant checkpoints in and out, measured: peak resident memory, files, dtype and wall time of `megazoo convert`
both ways, and the bytes `model.from_hf` reads per rank. Prints JSON lines, then a markdown table.

    python -m benchmarks.convert_memory [--layers 24 --hidden 1024 --ffn 2816 --vocab 32000]

A Llama-style model with random bf16 weights is written as a sharded HF folder (safetensors, 4 files); each
conversion runs in a fresh process that first converts a tiny model (every lazy import loaded), resets its peak
(/proc/self/clear_refs) and reports VmHWM above its VmRSS baseline. `model.from_hf` at tp = 1, 2, 8: the bytes
rank 0's reader copies out of the files for its own tensor-parallel slices (models/hf/converter.py: read_local;
replicated norms are read whole by every rank), against the model's total.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROBE = r"""
import gc, re, sys, time
from megazoo.recipes import cli

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

tiny, warm, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
assert cli.main(["convert", "hf-to-megazoo", tiny, "--out", warm + "/w1"]) == 0
assert cli.main(["convert", "megazoo-to-hf", warm + "/w1", "--out", warm + "/w2", "--tokenizer", "none"]) == 0
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
start = time.perf_counter()
assert cli.main(argv) == 0
print(status("VmHWM") - base, time.perf_counter() - start)
"""


def hf_folder(path: Path, layers: int, hidden: int, ffn: int, vocab: int) -> tuple[int, int]:
    """A random bf16 Llama-style HF folder in 4 safetensors files; (total bytes, largest tensor bytes)."""
    import transformers
    from safetensors.torch import save_file

    from megazoo.models.hf.llama import config_from_hf, entries

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=2048,
                                      tie_word_embeddings=False, dtype="bfloat16")
    path.mkdir(parents=True)
    config.save_pretrained(str(path))
    tensors = [(n, s) for e in entries(config_from_hf(config)) for n, s in zip(e.hf, e.hf_shapes)]
    per, weight_map, gen = -(-len(tensors) // 4), {}, torch.Generator().manual_seed(0)
    for k in range(4):
        name = f"model-{k + 1:05d}-of-00004.safetensors"
        part = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
                for n, s in tensors[k * per:(k + 1) * per]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    sizes = [torch.Size(s).numel() * 2 for _, s in tensors]
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": sum(sizes)},
                                                                   "weight_map": weight_map}))
    return sum(sizes), max(sizes)


def measure(tiny: Path, warm: Path, argv: list[str]) -> tuple[int, float]:
    run = subprocess.run([sys.executable, "-c", PROBE, str(tiny), str(warm), *argv], capture_output=True, text=True,
                         env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    peak, seconds = run.stdout.strip().splitlines()[-1].split()
    return int(peak), float(seconds)  # the conversion itself: not the interpreter's start or the warm-up


def from_hf_bytes(folder: Path, tp: int) -> int:
    """Bytes rank 0 of tp ranks reads for its slices (models/hf/converter.py: read_local)."""
    from megazoo.models.hf.converter import read_local
    from megazoo.models.hf.families import read_hf_config
    from megazoo.models.hf.safetensors_files import HFWeights
    from megazoo.models.layout import parameter_layout
    from megazoo.parallel.tensor import ShardSpec

    family, cfg, _ = read_hf_config(folder)
    weights, by_name = HFWeights(folder), {e.ours: e for e in family.entries(cfg)}
    for p in parameter_layout(cfg, tp):
        spec = ShardSpec(p.shape, p.tp_dim, p.sections, 0, tp) if p.tp_dim is not None else ShardSpec(p.shape)
        read_local(weights, by_name[p.name], spec, 0, torch.Size(spec.local_shape).numel())
    return weights.bytes_read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 24), ("hidden", 1024), ("ffn", 2816), ("vocab", 32000)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megazoo-convert-bench-") as scratch:
        root = Path(scratch)
        hf_folder(root / "tiny", 1, 128, 256, 256)
        total, largest = hf_folder(root / "hf", args.layers, args.hidden, args.ffn, args.vocab)
        rows = []
        peak, wall = measure(root / "tiny", root / "warm1", ["convert", "hf-to-megazoo", str(root / "hf"), "--out",
                                                             str(root / "ckpt")])
        files = len(list((root / "ckpt").glob("step_*/rank*.pt")))
        rows.append({"what": "hf-to-megazoo", "model_bytes": total, "largest_tensor": largest, "peak_rss": peak,
                     "files": files, "dtype": "bfloat16", "seconds": round(wall, 1)})
        peak, wall = measure(root / "tiny", root / "warm2", ["convert", "megazoo-to-hf", str(root / "ckpt"), "--out",
                                                             str(root / "back"), "--tokenizer", "none",
                                                             "--max-shard-size", f"{max(total // 4, largest)}"])
        config = json.loads((root / "back" / "config.json").read_text())
        rows.append({"what": "megazoo-to-hf", "model_bytes": total, "largest_tensor": largest, "peak_rss": peak,
                     "files": len(list((root / "back").glob("*.safetensors"))),
                     "dtype": config.get("dtype", config.get("torch_dtype")), "seconds": round(wall, 1)})
        for tp in (1, 2, 8):
            start = time.perf_counter()
            read = from_hf_bytes(root / "hf", tp)
            rows.append({"what": f"model.from_hf, tp {tp}: rank 0", "model_bytes": total, "bytes_read": read,
                         "share": round(read / total, 3), "seconds": round(time.perf_counter() - start, 1)})
    for row in rows:
        print(json.dumps(row))
    mb = lambda b: f"{b / 2**20:,.0f} MB"  # noqa: E731
    print("\n| direction | model | largest tensor | peak RSS above baseline | files | dtype | wall |")
    print("|---|---|---|---|---|---|---|")
    for r in rows[:2]:
        print(f"| {r['what']} | {mb(r['model_bytes'])} | {mb(r['largest_tensor'])} | {mb(r['peak_rss'])} | "
              f"{r['files']} | {r['dtype']} | {r['seconds']} s |")
    print("\n| model.from_hf | bytes read by rank 0 | of the model |\n|---|---|---|")
    for r in rows[2:]:
        tp = r["what"].split(": ")[0].removeprefix("model.from_hf, ")
        print(f"| {tp} | {mb(r['bytes_read'])} | {r['share']:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
