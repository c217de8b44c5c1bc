"""`megazoo reproduce NAME --out DIR`: each name's quick form writes DIR/NAME.md and DIR/NAME.png with the expected
rows. Planner numbers are exact; measured ones are checked for sanity, not speed. The claims read
recipes/tnlg-17b.toml, recipes/gpt-100b.toml and recipes/gpt-1t.toml."""

from __future__ import annotations

import json

import pytest
from hf_helpers import tiny_hf_model

from megazoo.recipes.reproduce.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(name, out, *extra):
    assert main([name, "--out", str(out), *extra]) == 0
    md, png = out / f"{name}.md", out / f"{name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size < 200_000
    return md.read_text(), json.loads((out / f"{name}.json").read_text())


def test_claims(tmp_path):
    md, data = _run("claims", tmp_path)
    for row in ["| T-NLG 17B: model parallelism without -> with ZeRO (256 V100-32GB) | 16 -> 4 |",
                "| 14 -> 4 |", "| 4x |", "| 8.50x |",  # 8.00x before fused_loss "auto" fused the head + loss (mb 17 at tp 4, not 16)
                "fits: 25.9 GB at ZeRO-2", "119.4 GB",  # 119.3 before the planner held the head's weight gradient beside d logits
                "| 38 TFLOPS/GPU, 15 PFLOPS |", "800 GPUs: 46.9 GB, does not fit; fits with CPU offload (22.2 GB) or "
                "on 1376 GPUs", "by the ZeRO paper's bytes 40.7 GB, fits on 1024 GPUs", "| 3.75x |", "| 25.5x |",
                "1.19x"]:
        assert row in md, row
    assert data["tnlg"]["smallest_tp"] == {"0": 14, "1": 4}
    # megazoo's ZeRO-1 also holds the owned fp32 gradient shard (4/N B/param; 2 at N = 2): pp 43 where the
    # paper's 2 + 2 + 12/N fits at pp 32; ZeRO-2 on 100B: +2/N (N = 25) of 6.3B params per device = +0.5 GB
    assert data["gpt1t"]["smallest_pp_without_offload"] == 43
    assert data["gpt1t"]["paper"]["smallest_pp_without_offload"] == 32
    assert round(data["gpt100b"]["paper"]["2"] / 1e9, 1) == 25.4
    for source in ("Turing-NLG", "Rajbhandari et al. 2020", "Extreme-scale model training", "DeepSpeed README"):
        assert source in md
    # the recorded dry runs (recipes/reproduce/dry_run_results.json, package data) are shown as measured
    assert "From recipes/reproduce/dry_run_results.json" in md and "peak GB (measured)" in md
    assert {row[0] for row in data["dry_run"]} >= {"tnlg-17b", "gpt-100b", "gpt-1t"}


def test_zero_memory(tmp_path):
    md, data = _run("zero-memory", tmp_path)
    assert "| 7.5B | 64 | 120 | 31.4 | 16.6 | 1.88 | 120 / 31.4 / 16.6 / 1.88 |" in md
    assert "| 1T | 1024 | 16000 | 4012 | 2014 | 15.6 |" in md
    rows = data["measured"]
    assert [(r["dp"], r["stage"]) for r in rows] == [(dp, s) for dp in (2, 4) for s in range(4)]
    for r in rows:
        m, p = r["measured"], r["planned"]
        assert m["params"] == pytest.approx(p["params"], rel=0.01)
        assert m["optimizer"] == pytest.approx(p["optimizer"], rel=0.01)
        if r["stage"] >= 2:  # stages 2 and 3 hold exactly the planned partitions (up to padding)
            assert sum(m.values()) == pytest.approx(sum(p.values()), rel=0.01)
    for dp in (2, 4):
        totals = [sum(r["measured"].values()) for r in rows if r["dp"] == dp]
        assert totals[3] < totals[2] < totals[1]  # each stage partitions one more kind of state


def test_zero_scale_quick(tmp_path):
    md, data = _run("zero-scale", tmp_path, "--quick")
    assert data["quick"] and data["world"] == 4
    assert {a["stage"] for a in data["attempts"]} == {0, 1, 2, 3}
    for stage in (0, 1, 2):
        assert data["largest"][str(stage)]["ok"], data["attempts"]
    for claim in ("| 4x (P_os) |", "| 8x (P_os+g) |", "| N_d x (P_os+g+p) |", "| 1.60x |", "| 2.29x |", "| 4.00x |"):
        assert claim in md


def test_pipeline_bubble_quick(tmp_path):
    md, data = _run("pipeline-bubble", tmp_path, "--quick")
    rows = data["rows"]
    assert [(r["pp"], r["schedule"]) for r in rows] == [  # dualpipev needs m >= 2 pp - 1: not at pp 4, m 4
        (p, s) for p in (2, 4) for s in ("gpipe", "1f1b", "interleaved", "zb_h1", "zbv", "dualpipev")
        if (p, s) != (4, "dualpipev")]
    theory = {(2, "gpipe"): 0.2, (2, "1f1b"): 0.2, (2, "interleaved"): 1 / 9, (2, "zb_h1"): 1 / 13,
              (2, "zbv"): 1 / 25, (2, "dualpipev"): 1 / 25, (4, "gpipe"): 3 / 7, (4, "1f1b"): 3 / 7, (4, "interleaved"): 3 / 11,
              (4, "zb_h1"): 3 / 15, (4, "zbv"): 3 / 27}
    for r in rows:
        assert r["bubble_theory"] == pytest.approx(theory[r["pp"], r["schedule"]])
        assert r["bubble_ideal"] == pytest.approx(r["bubble_theory"])  # m = 4 >= p: the lists reach the formula
        assert 0 <= r["bubble_measured"] < 1
        if r["schedule"] == "gpipe":
            assert r["live_per_stage"] == [4] * r["pp"]
        if r["schedule"] in ("1f1b", "zb_h1"):
            assert max(r["live_per_stage"]) <= r["pp"]
    assert "| 4 | 1f1b | 1 | 4 |" in md and "| 0.429 |" in md


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "tiny-gpt2"
    tiny_hf_model().save_pretrained(str(path))  # no tokenizer files: the shared GPT-2 BPE is used
    return path


def test_eval_with_tiny_hf_weights(tmp_path, weights, data_dir):
    md, data = _run("eval", tmp_path, "--weights", f"gpt2-1.5b={weights}", f"tiny={weights}", "--limit", "2",
                    "--data-dir", str(data_dir))
    res = data["results"]["gpt2-1.5b"]
    assert res["wikitext103"]["num_windows"] == 2 and res["lambada"]["num_examples"] == 2
    assert res["wikitext103"]["num_original_tokens"] == 245_566  # the real test file
    assert res["wikitext103"]["adjusted_ppl"] > res["wikitext103"]["ppl"] > 1
    assert 0 <= res["lambada"]["accuracy"] <= 1
    assert "| 17.48 [1] |" in md and "| 63.24 [1] |" in md and "--limit 2" in md
    assert "| megatron-8.3b | 10.81 | 66.51 |" in md and "| tnlg-17b | 10.21 | 67.98 |" in md
    assert "[1] Radford et al. 2019" in md
    tiny_row = next(line for line in md.splitlines() if line.startswith("| tiny |"))
    assert tiny_row.count("| - |") == 2  # no published numbers for an unknown name


@pytest.mark.parametrize("argv, message", [
    (["eval", "--weights", "gpt2-1.5b"], "NAME=DIR"),
    (["eval", "--weights", "gpt2-1.5b=/nonexistent/dir"], "/nonexistent/dir"),
    (["eval"], "needs --weights"),
    (["claims", "--weights", "a=b"], "--weights is for `reproduce eval`"),
])
def test_bad_input_exits_2(tmp_path, capsys, argv, message):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megazoo reproduce: error:") and message in err
