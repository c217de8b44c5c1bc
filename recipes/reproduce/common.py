"""Shared parts of `megazoo reproduce`: the report each table returns, markdown tables and headless figures.
Everything a reproduction measures lives in the installed package (zero_bench.py, pipeline_bench.py); the
benchmarks/ scripts of a checkout print the same measurements and are never imported from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

class ReproduceError(Exception):
    """Bad input to a reproduction (a missing weights dir, a malformed --weights): exit 2 with the message."""


@dataclass
class Report:
    """One reproduction: a markdown document (title, notes, tables) and a matplotlib Figure (or None)."""

    title: str
    sections: list[str] = field(default_factory=list)
    figure: object = None  # matplotlib.figure.Figure
    data: dict = field(default_factory=dict)  # the numbers behind the tables (written as NAME.json)

    def add(self, *texts: str) -> None:
        self.sections += list(texts)

    def markdown(self) -> str:
        return "\n\n".join([f"# {self.title}", *self.sections]) + "\n"


def table(head: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` is one character per column, 'l' or 'r' (default: first left, rest right)."""
    align = align or "l" + "r" * (len(head) - 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def figure(ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.4):
    """A headless matplotlib Figure (no pyplot, no display) and its axes as a flat list."""
    try:
        import matplotlib
    except ImportError:
        raise ReproduceError("matplotlib is not installed: pip install matplotlib (a megazoo dependency)") from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def save_figure(fig, path: Path, dpi: int = 80) -> None:
    fig.savefig(path, dpi=dpi)


def gb(nbytes: float, digits: int = 2) -> str:
    return f"{nbytes / 1e9:.{digits}f}"
