"""benchmarks/pipeline.py --overlap (recipes/reproduce/overlap_bench.py) at a tiny size: its argument checks, the
all-to-all timer (the test double that measures the exposed all-to-all time and emulates a latency), and that
DualPipe-V's rows with and without fb_overlap run and print. No wall-clock thresholds: the timer is held to lower
bounds its sleeps guarantee, the rows to what they report, not to how fast they ran."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from benchmarks import pipeline as bench
from harness import run_distributed
from megazoo.recipes.reproduce.overlap_bench import ROWS, _TimedAllToAll, markdown, measure_overlap


@pytest.mark.parametrize("argv, message", [
    (["--overlap", "--m", "2"], "--overlap needs --m >= 3"),
    (["--overlap", "--layers", "6"], "--layers a multiple of 4"),
    (["--overlap", "--a2a-latency-ms", "0,fast"], "--a2a-latency-ms '0,fast': expected comma-separated numbers"),
    (["--overlap", "--repeat", "0"], "--repeat >= 1"),
])
def test_bad_overlap_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _timed(latency_s: float):
    """Both ranks: one synchronous and one asynchronous all-to-all through the timer."""
    timer = _TimedAllToAll(dist.all_to_all_single, latency_s)
    x = torch.arange(4.0) + 10 * dist.get_rank()
    out = torch.empty(4)
    timer(out, x)
    after_sync = timer.blocked
    back = torch.empty(4)
    handle = timer(back, out, async_op=True)
    assert timer.blocked == after_sync  # launching does not block
    handle.wait()
    return out, back, after_sync, timer.blocked


def test_the_timer_passes_the_collective_through_and_holds_each_result_back_by_the_latency():
    for rank, (out, back, after_sync, blocked) in enumerate(run_distributed(_timed, 2, 0.05)):
        assert out.tolist() == ([0.0, 1.0, 10.0, 11.0] if rank == 0 else [2.0, 3.0, 12.0, 13.0])
        assert back.tolist() == (torch.arange(4.0) + 10 * rank).tolist()  # there and back
        assert after_sync >= 0.05 and blocked >= 0.05  # the sync call, then the async wait: each held back


def test_dualpipev_rows_with_and_without_overlap_run_and_print():
    rows = measure_overlap(m=3, steps=1, layers=4, d_model=16, rows=ROWS[2:])
    assert [(r["schedule"], r["fb_overlap"]) for r in rows] == [("dualpipev", "off"), ("dualpipev", "sub-stages"),
                                                                ("dualpipev", "on")]
    for r in rows:
        assert 0 <= r["bubble"] < 1 and 0 < r["a2a_exposed"] < 1 and r["step_s"] > 0
        assert r["bubble_theory"] == pytest.approx(1 / 19)  # (p - 1) / (6 m + p - 1)
        assert (r["a2a_logged"] is not None) == (r["fb_overlap"] != "off")  # the overlap engine's own log
        assert (r["overlaps"] > 0) == (r["fb_overlap"] == "on")  # the control row's pairing is off
    table = markdown(rows)
    assert len(table) == 5 and table[2].startswith("| 0 ms | dualpipev | off |") and "1.00x" in table[2]
    assert table[3].startswith("| 0 ms | dualpipev | sub-stages |") and table[4].startswith("| 0 ms | dualpipev | on |")
