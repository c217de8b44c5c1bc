"""Packing vs padding on a real length distribution: effective tokens per optimizer step.

The dataset: the standard library's documented functions (data/sft/stdlib_sft.py: prompt = docstring, response =
signature), tokenized with GPT-2's BPE (../shared/data/gpt2_bpe) through the ChatML template by the same code
as `megazoo preprocess --format sft` (rows longer than the sequence length are reported and skipped here). For
each sequence length, the rows an epoch needs packed (best-fit decreasing, data/sft/packing.py) and padded (one
example per row), and per step of `--global-batch` rows: example tokens, response targets trained on, and
padding. Nothing is timed: the figures are counts, the same on every machine.

    python benchmarks/sft_packing.py [--gpt2-bpe DIR] [--seq-len 256 512 1024] [--global-batch 16] [--max-bytes N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from megazoo.data.sft.dataset import SFTDataset
from megazoo.data.sft.packing import SFTRows
from megazoo.data.sft.preprocess import preprocess_sft
from megazoo.data.sft.stdlib_sft import stdlib_sft_rows
from megazoo.data.tokenizers.loading import load_tokenizer

DEFAULT_BPE = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2_bpe"


def measure(prefix: str, seq_len: int, global_batch: int) -> dict:
    dataset = SFTDataset(prefix)
    out = {"seq_len": seq_len, "examples": len(dataset), "mean_example_tokens": float(dataset.lengths.mean())}
    for name, packing in (("padded", False), ("packed", True)):
        stats = SFTRows(dataset, seq_len, packing).stats()
        steps = stats.rows / global_batch
        out[name] = {"rows": stats.rows, "fill": round(stats.fill, 4),
                     "example_tokens_per_step": round(stats.tokens / steps, 1),
                     "response_targets_per_step": round(stats.targets / steps, 1),
                     "steps_per_epoch": round(steps, 1)}
    out["packing_speedup"] = round(out["padded"]["rows"] / out["packed"]["rows"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpt2-bpe", default=str(DEFAULT_BPE), help="GPT-2 BPE directory (vocab.json + merges.txt)")
    parser.add_argument("--seq-len", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--max-bytes", type=int, default=None, help="stdlib source bytes (default: all of it)")
    args = parser.parse_args(argv)
    rows, _ = stdlib_sft_rows(args.max_bytes)
    tokenizer = load_tokenizer(args.gpt2_bpe)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "stdlib_sft.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
        for seq_len in args.seq_len:
            prefix = str(Path(tmp) / f"sft{seq_len}")
            manifest = preprocess_sft([source], tokenizer, prefix, seq_len=seq_len, template="chatml",
                                      bad_rows="skip")
            result = measure(prefix, seq_len, args.global_batch)
            result["rows_longer_than_seq_len"] = len(manifest["bad_rows"])
            results.append(result)
    print(json.dumps({"dataset": "stdlib docstring -> signature", "rows": len(rows), "template": "chatml",
                      "tokenizer": "gpt2", "global_batch": args.global_batch, "results": results}, indent=1))
    print()
    print("| seq_len | examples (too long) | padded rows | packed rows | padded fill | packed fill | "
          "tokens/step padded | tokens/step packed | response targets/step padded | packed | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        p, k = r["padded"], r["packed"]
        print(f"| {r['seq_len']} | {r['examples']:,} ({r['rows_longer_than_seq_len']:,}) | {p['rows']:,} | "
              f"{k['rows']:,} | {p['fill']:.1%} | {k['fill']:.1%} | {p['example_tokens_per_step']:,.0f} | "
              f"{k['example_tokens_per_step']:,.0f} | {p['response_targets_per_step']:,.0f} | "
              f"{k['response_targets_per_step']:,.0f} | {r['packing_speedup']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
