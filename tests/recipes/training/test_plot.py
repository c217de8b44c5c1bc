"""`megazoo plot`: a PNG of a real (tiny) training run's metrics.jsonl, runs overlaid, and clear refusals."""

from __future__ import annotations

import json

import pytest
from recipe_helpers import tiny_resolved

from megazoo.parallel.topology import Topology
from megazoo.recipes.training.plot import main, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny training run through the training entry's own loop (metrics.jsonl written as `megazoo train` does)."""
    from megazoo.recipes.train import run

    path = tmp_path_factory.mktemp("runs") / "tiny"
    run(tiny_resolved(train={"steps": 6, "eval_every": 3, "precision": "fp32"}, run={"dir": str(path)}),
        Topology.solo())
    return path


def test_plot_writes_a_png_of_a_training_run(run_dir, tmp_path, capsys):
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(6))
    assert any("val_loss" in r for r in records)
    out = tmp_path / "loss.png"
    assert main([str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and 5_000 < out.stat().st_size < 500_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_plot_overlays_several_runs(run_dir, tmp_path):
    other = tmp_path / "synthetic"
    other.mkdir()
    lines = [json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 1000.0 + s,
                         "peak_memory_bytes": 2e8, **({"val_loss": 4.8} if s == 4 else {})}) for s in range(8)]
    (other / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 8, \"lo")  # a torn last line is skipped
    assert len(read_metrics(other)) == 8
    out = tmp_path / "sub" / "both.png"
    assert main([str(run_dir), str(other), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("case", ["missing", "no-metrics", "empty-metrics"])
def test_plot_refuses_a_run_dir_without_metrics(tmp_path, capsys, case):
    bad = tmp_path / "run"
    if case != "missing":
        bad.mkdir()
    if case == "empty-metrics":
        (bad / "metrics.jsonl").write_text("")
    out = tmp_path / "x.png"
    assert main([str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megazoo plot: error:") and str(bad) in err
    assert not out.exists()
