"""`megazoo plot RUN_DIR [RUN_DIR ...] --out FILE.png`: pictures of training runs from their metrics.jsonl.

Four panels per step, every run overlaid (one colour per run): training loss with the validation loss as
markers, learning rate, tokens/s, and peak memory per rank (GB; GPU: the caching allocator's peak reserved
bytes, CPU: peak RSS). When a run is a mixture of experts (its records hold moe_load_max), two more: the expert
load of every MoE layer (the most loaded expert's share max/mean solid, the least loaded's min/mean dashed; one
shade of the run's colour per layer) and the router's aux loss (recipes/training/moe_metrics.py). matplotlib, headless (Agg), no display needed. A run directory that does not exist or
holds no metrics.jsonl lines ends the command with exit 2 naming it, before anything is drawn.
recipes/cli.py wires `register(subparsers)` in; `main(argv)` runs it alone (`python -m megazoo.recipes.training.plot`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"),
          ("peak_memory_bytes", "peak memory per rank (GB)"))
MOE_PANELS = (("moe_load_max", "expert load per MoE layer (max/mean solid, min/mean dashed)"),
              ("moe_aux_loss", "router aux loss"))


class PlotError(Exception):
    """A run directory that cannot be plotted: exit 2 with the message."""


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The step records of RUN_DIR/metrics.jsonl (a torn last line, as a killed run may leave, is skipped)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise PlotError(f"run directory {path} does not exist")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise PlotError(f"run directory {path} has no metrics.jsonl (was it a training run's run.dir?)")
    records = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    if not records:
        raise PlotError(f"run directory {path}: metrics.jsonl holds no step records")
    return records


def _series(records: list[dict], key: str) -> tuple[list, list]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def figure(runs: dict[str, list[dict]]):
    """The matplotlib Figure of the runs (module docstring); MoE panels only when a run has them."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    moe = any("moe_load_max" in r for records in runs.values() for r in records)
    panels = PANELS + (MOE_PANELS if moe else ())
    fig = Figure(figsize=(10, 6.5 if not moe else 9.5), layout="constrained")
    axes = [ax for row in fig.subplots(len(panels) // 2, 2) for ax in row]
    for i, (label, records) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        for ax, (key, _) in zip(axes, PANELS):
            steps, values = _series(records, key)
            if key == "peak_memory_bytes":
                values = [v / 1e9 for v in values]
            ax.plot(steps, values, color=colour, lw=1.2, label=label if key != "loss" else f"{label} train")
        steps, values = _series(records, "val_loss")
        if steps:
            axes[0].plot(steps, values, "o--", color=colour, ms=5, lw=1, label=f"{label} validation")
        if moe:
            _moe_panels(axes[4], axes[5], label, records, colour)
    for ax, (_, title) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if len(runs) > 1:
        axes[1].legend(fontsize=8)
    if moe:
        axes[4].legend(fontsize=7)
    return fig


def _moe_panels(load_ax, aux_ax, label: str, records: list[dict], colour: str) -> None:
    rows = [r for r in records if isinstance(r.get("moe_load_max"), list)]
    if not rows:
        return
    steps, layers = [r["step"] for r in rows], rows[-1].get("moe_layers") or list(range(len(rows[-1]["moe_load_max"])))
    for j, layer in enumerate(layers):
        shade = 1.0 - 0.6 * j / max(len(layers) - 1, 1)
        load_ax.plot(steps, [r["moe_load_max"][j] for r in rows], color=colour, alpha=shade, lw=1.2,
                     label=f"{label} layer {layer}")
        load_ax.plot(steps, [r["moe_load_min"][j] for r in rows], "--", color=colour, alpha=shade, lw=1)
    steps, values = _series(records, "moe_aux_loss")
    aux_ax.plot(steps, values, color=colour, lw=1.2, label=label)


def plot_runs(runs: dict[str, list[dict]], out: str | Path, dpi: int = 80) -> Path:
    fig = figure(runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out


def _labels(dirs: list[str]) -> list[str]:
    """Each run's name: its folder name, or the path as given when two runs share a folder name."""
    names = [Path(d).resolve().name or str(d) for d in dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, dirs)]


def run(args: argparse.Namespace) -> int:
    try:
        if Path(args.out).suffix.lower() != ".png":
            raise PlotError(f"--out {args.out}: give a .png file")
        runs = {label: read_metrics(d) for label, d in zip(_labels(args.run_dirs), args.run_dirs)}
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise PlotError("matplotlib is not installed: pip install matplotlib (a megazoo dependency)") from None
    except PlotError as err:
        print(f"megazoo plot: error: {err}", file=sys.stderr)
        return 2
    out = plot_runs(runs, args.out)
    steps = ", ".join(f"{label}: {len(records)} steps" for label, records in runs.items())
    print(f"wrote {out} ({steps})")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="training run directories (run.dir)")
    parser.add_argument("--out", required=True, metavar="FILE.png", help="the picture to write")


def register(subparsers) -> argparse.ArgumentParser:
    """Add `plot` to the `megazoo` subcommands; its func returns the exit code."""
    parser = subparsers.add_parser("plot", help="plot loss, lr, tokens/s and memory of runs (metrics.jsonl)",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megazoo plot", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
