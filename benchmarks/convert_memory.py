"""Giant checkpoints in and out, measured: peak resident memory, files, dtype and wall time of `megazoo convert`
(HF <-> megazoo, megazoo <-> DCP), and of `model.from_hf` loading one rank at 1, 2 and 8 ranks. Prints JSON lines,
then the markdown tables of the README's "Giant checkpoints in and out".

    python -m benchmarks.convert_memory [--layers 24 --hidden 1024 --ffn 2816 --vocab 32000]

A Llama-style model with random bf16 weights is written as a sharded HF folder (safetensors, 4 files); each
conversion runs in a fresh process that first converts a tiny model (every lazy import loaded), resets its peak
(/proc/self/clear_refs) and reports VmHWM above its VmRSS baseline. `model.from_hf` at 1, 2 and 8 ranks (tp = 1,
2, 8): each rank's views (bf16 parameters + fp32 masters of its tensor-parallel slices, allocated and touched
before the reset) filled in a fresh process by models/hf/converter.py's fill_views_from_hf, as a training rank
loads them: the bytes its reader copies out against its share (its views' elements the files hold, in bf16),
the peak above the views (the loading's own transient memory) next to what `megazoo plan` states for it
(recipes/planner/hf_load.py), and the wall time. Every rank of each layout is measured; the table gives the
largest peak and wall and the worst bytes/share.
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
assert cli.main(["convert", "megazoo-to-dcp", warm + "/w1", "--out", warm + "/w3"]) == 0
assert cli.main(["convert", "dcp-to-megazoo", warm + "/w3", "--out", warm + "/w4"]) == 0
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


RANK_PROBE = r"""
import gc, json, re, sys, time
import torch
from megazoo.models.hf.converter import fill_views_from_hf
from megazoo.models.hf.families import read_hf_config
from megazoo.models.hf.safetensors_files import HFWeights
from megazoo.models.layout import parameter_layout
from megazoo.parallel.checkpoint.views import StateView
from megazoo.parallel.tensor import ShardSpec

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

def views(folder, tp, rank):
    family, cfg, _ = read_hf_config(folder)
    out, share = [], 0
    for p in parameter_layout(cfg, tp):
        spec = ShardSpec(p.shape, p.tp_dim, p.sections, rank, tp) if p.tp_dim is not None else ShardSpec(p.shape)
        n = torch.Size(spec.local_shape).numel()
        out += [StateView(p.name, spec, "param", 0, n, torch.zeros(n, dtype=torch.bfloat16)),
                StateView(p.name, spec, "master", 0, n, torch.zeros(n, dtype=torch.float32))]
        real = n
        if p.name in ("wte.weight", "lm_head.weight"):  # padded vocabulary rows: zeros, not in the files
            first = spec.ranges()[0][0]
            real = max(0, min(spec.local_shape[0], cfg.vocab_size - first)) * p.shape[1]
        share += real * 2
    return family, cfg, out, share

tiny, folder, tp, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
family, cfg, warm, _ = views(tiny, 1, 0)
fill_views_from_hf(HFWeights(tiny), family, cfg, warm)  # every lazy import loaded
family, cfg, mine, share = views(folder, tp, rank)
del warm
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
start = time.perf_counter()
weights = HFWeights(folder)
fill_views_from_hf(weights, family, cfg, mine)
print(json.dumps({"peak": status("VmHWM") - base, "seconds": time.perf_counter() - start,
                  "read": weights.bytes_read, "largest_read": weights.largest_read, "share": share}))
"""


def from_hf_rank(tiny: Path, folder: Path, tp: int, rank: int) -> dict:
    """One rank of a tp-`tp` layout loading its views straight from the HF folder, in a fresh process."""
    run = subprocess.run([sys.executable, "-c", RANK_PROBE, str(tiny), str(folder), str(tp), str(rank)],
                         capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def conversion(root: Path, what: str, argv: list[str], total: int, largest: int, out: Path, files: str) -> dict:
    """One `megazoo convert` measured in a fresh process: its row of the table."""
    peak, wall = measure(root / "tiny", root / f"warm-{what}", argv)
    if (out / "config.json").is_file() and not (out / ".metadata").is_file():  # an HF folder: as transformers reads it
        config = json.loads((out / "config.json").read_text())
        dtype = config.get("dtype", config.get("torch_dtype"))
    elif (out / ".metadata").is_file():  # a DCP folder: the dtypes of its tensors
        from megazoo.parallel.checkpoint.dcp import DCPReader
        dtype = "/".join(sorted(d.removeprefix("torch.") for d in DCPReader(out).dtypes()))
    else:
        from megazoo.parallel.checkpoint.consolidate import CheckpointReader
        dtype = str(CheckpointReader(out).param_dtype()).removeprefix("torch.")
    return {"what": what, "model_bytes": total, "largest_tensor": largest, "peak_rss": peak,
            "files": len(list(out.glob(files))), "dtype": dtype, "seconds": round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 24), ("hidden", 1024), ("ffn", 2816), ("vocab", 32000)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--only-from-hf", action="store_true", help="only the model.from_hf rows (e.g. again under "
                        "MALLOC_MMAP_THRESHOLD_=131072, which stops glibc keeping freed blocks of earlier reads)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megazoo-convert-bench-") as scratch:
        root = Path(scratch)
        hf_folder(root / "tiny", 1, 128, 256, 256)
        total, largest = hf_folder(root / "hf", args.layers, args.hidden, args.ffn, args.vocab)
        rows = [] if args.only_from_hf else [
                conversion(root, "hf-to-megazoo", ["convert", "hf-to-megazoo", str(root / "hf"), "--out",
                                                    str(root / "ckpt")], total, largest, root / "ckpt",
                           "step_*/rank*.pt"),
                conversion(root, "megazoo-to-hf", ["convert", "megazoo-to-hf", str(root / "ckpt"), "--out",
                                                    str(root / "back"), "--tokenizer", "none", "--max-shard-size",
                                                    f"{max(total // 4, largest)}"], total, largest, root / "back",
                           "*.safetensors")]
        if not args.only_from_hf:
            rows.append(conversion(root, "megazoo-to-dcp", ["convert", "megazoo-to-dcp", str(root / "ckpt"), "--out",
                                                         str(root / "dcp")], total, largest, root / "dcp",
                               "*.distcp"))
            rows.append(conversion(root, "dcp-to-megazoo", ["convert", "dcp-to-megazoo", str(root / "dcp"), "--out",
                                                         str(root / "ckpt2")], total, largest, root / "ckpt2",
                               "step_*/rank*.pt"))
        from megazoo.models.hf.families import read_hf_config
        from megazoo.recipes.planner.hf_load import load_memory

        _, cfg, _ = read_hf_config(root / "hf")
        for tp in (1, 2, 8):
            ranks = [from_hf_rank(root / "tiny", root / "hf", tp, rank) for rank in range(tp)]
            rows.append({"what": f"model.from_hf, {tp} rank(s) (tp {tp})", "model_bytes": total,
                         "read_per_share": [round(r["read"] / r["share"], 4) for r in ranks],
                         "read_rank0": ranks[0]["read"], "share_rank0": ranks[0]["share"],
                         "peak_rss": max(r["peak"] for r in ranks), "planned_peak": load_memory(cfg, tp, 2, 4).peak,
                         "seconds": round(max(r["seconds"] for r in ranks), 1)})
    for row in rows:
        print(json.dumps(row))
    mb = lambda b: f"{b / 2**20:,.0f} MB"  # noqa: E731
    loads = [r for r in rows if r["what"].startswith("model.from_hf")]
    if len(rows) > len(loads):
        print("\n| direction | model | largest tensor | peak RSS above baseline | files | dtype | wall |")
        print("|---|---|---|---|---|---|---|")
    for r in rows[:len(rows) - len(loads)]:
        print(f"| {r['what']} | {mb(r['model_bytes'])} | {mb(r['largest_tensor'])} | {mb(r['peak_rss'])} | "
              f"{r['files']} | {r['dtype']} | {r['seconds']} s |")
    print("\n| model.from_hf | rank 0 reads / its share | read / share, every rank | peak RSS above its views "
          "(largest rank) | `megazoo plan` states | wall (slowest rank) |\n|---|---|---|---|---|---|")
    for r in loads:
        spread = f"{min(r['read_per_share']):.3f}-{max(r['read_per_share']):.3f}"
        print(f"| {r['what'].removeprefix('model.from_hf, ')} | {mb(r['read_rank0'])} / {mb(r['share_rank0'])} | "
              f"{spread} | {mb(r['peak_rss'])} | {mb(r['planned_peak'])} | {r['seconds']} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
