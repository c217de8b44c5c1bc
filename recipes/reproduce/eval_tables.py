"""`megazoo reproduce eval` and `pipeline-bubble`.

eval             WikiText-103 adjusted perplexity and LAMBADA accuracy of every `--weights NAME=DIR` (a Hugging
                 Face GPT-2 directory or a megazoo checkpoint) through the same functions as `megazoo eval`
                 (eval/cli.py's evaluate: eval/wikitext103.py with Megatron-LM's overlapping windows, stride 32,
                 and its detokenizer-based token ratio; eval/lambada.py's strict last-word accuracy), beside the
                 published numbers of the model NAME names.
pipeline-bubble  pipeline_bench.py (the Trainer on pp local gloo ranks per schedule): measured bubble next to
                 (p - 1) / (v m + p - 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megazoo.recipes.reproduce.common import Report, ReproduceError, figure, table
from megazoo.recipes.reproduce.pipeline_bench import measure_schedules

SRC_GPT2 = "Radford et al. 2019, \"Language Models are Unsupervised Multitask Learners\", Table 3"
SRC_MEGATRON = "Shoeybi et al. 2019, \"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model " \
               "Parallelism\", Table 3"
SRC_TNLG = "Microsoft Research blog, \"Turing-NLG: A 17-billion-parameter language model by Microsoft\" (Feb. 2020)"
# name -> (WikiText-103 perplexity, LAMBADA accuracy %, source)
PUBLISHED = {
    "gpt2-117m": (37.50, 45.99, SRC_GPT2), "gpt2-345m": (26.37, 55.48, SRC_GPT2),
    "gpt2-774m": (22.05, 60.12, SRC_GPT2), "gpt2-1.5b": (17.48, 63.24, SRC_GPT2),
    "megatron-8.3b": (10.81, 66.51, SRC_MEGATRON), "tnlg-17b": (10.21, 67.98, SRC_TNLG),
}
ALIASES = {"gpt2-762m": "gpt2-774m", "gpt2": "gpt2-117m", "gpt2-medium": "gpt2-345m", "gpt2-large": "gpt2-774m",
           "gpt2-xl": "gpt2-1.5b"}
TOKENIZER_FILES = ("vocab.json", "encoder.json", "tokenizer.json")


def parse_weights(items: list[str]) -> list[tuple[str, Path]]:
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ReproduceError(f"--weights {item!r} is invalid; valid: NAME=DIR, e.g. gpt2-1.5b=/models/gpt2-xl")
        if not Path(path).is_dir():
            raise ReproduceError(f"--weights {name}={path}: directory not found")
        out.append((name, Path(path)))
    return out


def _eval_args(task: str, name: str, path: Path, args, data_dir: Path) -> argparse.Namespace:
    hf = (path / "config.json").is_file()
    tokenizer = args.tokenizer
    if tokenizer is None and not any((path / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = str(data_dir / "gpt2_bpe")
    data = data_dir / ("wikitext103/wiki.test.tokens" if task == "wikitext103" else "lambada/lambada_test.jsonl")
    return argparse.Namespace(task=task, hf=str(path) if hf else None, checkpoint=None if hf else str(path),
                              data=str(data), tokenizer=tokenizer, json=None, limit=args.limit,
                              batch_size=args.batch_size, tp=1, backend="megazoo", stride=32)


def eval_table(args) -> Report:
    from megazoo.eval.cli import evaluate
    from megazoo.parallel.topology import Topology

    weights = parse_weights(args.weights)
    if not weights:
        raise ReproduceError("reproduce eval needs --weights NAME=DIR [NAME=DIR ...] (Hugging Face GPT-2 dirs or "
                             f"megazoo checkpoints; NAME picks the published row: {', '.join(PUBLISHED)})")
    data_dir = Path(args.data_dir)
    if not data_dir.is_dir():
        raise ReproduceError(f"--data-dir {data_dir}: directory not found (it holds wikitext103/, lambada/, gpt2_bpe/: "
                             "`megazoo data fetch all` fills the default one)")
    results = {}
    for name, path in weights:
        results[name] = {}
        for task in ("wikitext103", "lambada"):
            args.report(f"  eval: {name} {task} ({path})")
            try:
                results[name][task] = evaluate(_eval_args(task, name, path, args, data_dir), Topology.solo("cpu"))
            except (FileNotFoundError, ValueError) as err:
                raise ReproduceError(f"--weights {name}={path}: {err}") from None
    rep = Report("Zero-shot evaluation: WikiText-103 and LAMBADA, measured beside the published numbers")
    limited = f"--limit {args.limit}: only the first {args.limit} windows / examples, NOT the published protocol. " \
        if args.limit else ""
    rep.add(f"{limited}WikiText-103: adjusted perplexity (Megatron-LM's protocol: overlapping windows of the "
            "model's context, 1024 tokens for GPT-2, stride 32; the BPE perplexity raised to the token ratio of "
            "the detokenized test file over its "
            "245,566 words) on wikitext103/wiki.test.tokens. LAMBADA: strict last-word accuracy on OpenAI's "
            "detokenized lambada_test.jsonl (5,153 examples). Data: " + str(data_dir) + ".")
    rows, sources = [], {}
    for name, res in results.items():
        wiki, lamb = res["wikitext103"], res["lambada"]
        pub = PUBLISHED.get(ALIASES.get(name, name))
        if pub:
            sources[pub[2]] = len(sources) + 1
        ref = f" [{sources[pub[2]]}]" if pub else ""
        rows.append([name, f"{wiki['adjusted_ppl']:.2f}", f"{wiki['ppl']:.2f}", f"{pub[0]:.2f}{ref}" if pub else "-",
                     f"{100 * lamb['accuracy']:.2f}", f"{pub[1]:.2f}{ref}" if pub else "-",
                     f"{wiki['num_scored_tokens']:,} / {lamb['num_examples']:,}"])
    rep.add(table(["weights", "WikiText-103 adjusted ppl", "ppl (BPE)", "published ppl", "LAMBADA acc %",
                   "published acc %", "scored tokens / examples"], rows))
    rep.add("Published numbers (every model the table knows, measured or not):",
            table(["model", "WikiText-103 ppl", "LAMBADA acc %", "source"],
                  [[k, f"{v[0]:.2f}", f"{v[1]:.2f}", v[2]] for k, v in PUBLISHED.items()], "lrrl"))
    if sources:
        rep.add("\n".join(f"[{i}] {s}" for s, i in sources.items()))
    rep.data = {"results": results, "published": PUBLISHED, "limit": args.limit}
    fig, axes = figure(ncols=2, width=4.2)
    names = list(results)
    xs = range(len(names))
    for ax, key, pub_i, label in ((axes[0], "wikitext103", 0, "WikiText-103 adjusted ppl"),
                                  (axes[1], "lambada", 1, "LAMBADA accuracy %")):
        got = [results[n][key]["adjusted_ppl"] if key == "wikitext103" else 100 * results[n][key]["accuracy"]
               for n in names]
        pub = [(PUBLISHED.get(ALIASES.get(n, n)) or (float("nan"),) * 2)[pub_i] for n in names]
        ax.bar([x - 0.2 for x in xs], got, 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], pub, 0.4, label="published")
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_title(label + (f" (--limit {args.limit})" if args.limit else ""), fontsize=9)
        if key == "wikitext103":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    rep.figure = fig
    return rep


def pipeline_bubble(args) -> Report:
    rows = (measure_schedules(m=4, steps=1, layers=8, report=args.report) if args.quick
            else measure_schedules(report=args.report))
    rep = Report("Pipeline bubble per schedule: measured on local gloo ranks vs theory")
    rep.add("Theory (Narayanan et al. 2021, \"Efficient Large-Scale Language Model Training on GPU Clusters Using "
            "Megatron-LM\", sec. 2.2): bubble fraction (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + "
            "p - 1) for interleaved 1F1B with v virtual stages per rank; with F = B = W (Qi et al. 2024, \"Zero "
            "Bubble Pipeline Parallelism\"): (p - 1) / (3 m + p - 1) for ZB-H1 and (p - 1) / (6 m + p - 1) for ZBV "
            "(two chunks per rank in a V) and for DualPipeV run without overlap (it needs m >= 2p - 1); 1F1B and "
            "ZB-H1 keep at most p micro-batches of activations alive, GPipe all m, ZBV 2p half-size chunks, "
            "DualPipeV 2p + 1. Measured: recipes/reproduce/pipeline_bench.py (benchmarks/pipeline.py)"
            + (" --m 4 --steps 1 --layers 8 (--quick)" if args.quick else " (m 8, 4 steps, 8 layers)")
            + ": the Trainer on pp CPU gloo ranks, gpt2-tiny, micro-batch 4 x seq 64, fp32; each rank's idle share "
            "of the schedule, averaged over ranks. On this 2-core machine pp ranks time-slice 2 cores, so the "
            "measured bubble is inflated; the live micro-batch counts are exact.")
    rep.add(table(["pp", "schedule", "v", "m", "bubble measured", "bubble theory", "bubble ideal (lists)",
                   "tokens/s", "live micro-batches per stage"],
                  [[r["pp"], r["schedule"], r["v"], r["m"], f"{r['bubble_measured']:.3f}",
                    f"{r['bubble_theory']:.3f}", f"{r['bubble_ideal']:.3f}", f"{r['tokens_per_s']:.0f}",
                    r["live_per_stage"]] for r in rows], "rlrrrrrrl"))
    rep.data = {"rows": rows, "quick": args.quick}
    fig, (ax,) = figure(width=6)
    labels = [f"pp{r['pp']}\n{r['schedule']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["bubble_measured"] for r in rows], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["bubble_theory"] for r in rows], 0.4, label="theory")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set(ylabel="bubble fraction", title=f"pipeline bubble, m = {rows[0]['m']} micro-batches")
    ax.legend(fontsize=8)
    rep.figure = fig
    return rep
