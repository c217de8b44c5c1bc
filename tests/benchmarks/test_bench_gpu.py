"""benchmarks/bench_gpu.py's pure parts (the benchmark itself needs a GPU: `make bench-gpu`): the FLOPs formulas,
the case list, MFU, the table, the planner's micro-batch, and the clear refusal without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_gpu as bg
from megazoo.models.flops import model_flops_per_token
from megazoo.models.presets import get_preset

REPO = Path(__file__).resolve().parents[2]


def test_flops_formulas():
    cfg = get_preset("llama3.2-1b")
    vocab, s = cfg.padded_vocab(1), 2048
    full, causal = bg.flops_per_token(cfg, s, vocab, False), bg.flops_per_token(cfg, s, vocab, True)
    assert full == model_flops_per_token(cfg, s, vocab)  # the non-causal count is the repo's MFU count
    attention = 12 * cfg.n_layer * s * cfg.n_head * cfg.head_dim
    assert full - causal == attention / 2
    # 6 x (1.24B matmul parameters incl. the 128,256 x 2048 head) = 7.42 GFLOP, + attention: 7.82 / 8.22 GFLOP
    assert causal == pytest.approx(7.817e9, rel=1e-3) and full == pytest.approx(8.220e9, rel=1e-3)


def test_cases_and_names():
    cs = bg.cases(("gpt2-1.5b",))
    assert [c.name for c in cs] == ["gpt2-1.5b compiled bf16", "gpt2-1.5b compiled fp8-tensorwise",
                                    "gpt2-1.5b compiled fp8-rowwise", "gpt2-1.5b eager bf16",
                                    "gpt2-1.5b compiled +AC bf16"]
    every = bg.cases()  # the budget cuts from the end: first every model's compiled bf16, then Llama 3B's FP8
    assert len(every) == 15 and len(set(every)) == 15
    assert [c.name for c in every[:5]] == ["llama3.2-3b compiled bf16", "gpt2-1.5b compiled bf16",
                                           "llama3.2-1b compiled bf16", "llama3.2-3b compiled fp8-tensorwise",
                                           "llama3.2-3b compiled fp8-rowwise"]


def test_mfu_and_table():
    cfg = get_preset("gpt2-1.5b")
    row = bg.fill_mfu(bg.Row(bg.Case("gpt2-1.5b"), micro_batch=4, seq_len=1024, tokens_per_s=32194.0,
                             peak_memory_gb=51.2, loss=10.9), cfg, cfg.padded_vocab(1), 989e12)
    # the one H100 point, 32,194 tokens/s, over the spec peak (989 TFLOP/s; the 42.9% was over
    # benchmarks/kernels.py's measured matmul ceiling): 10.27 GFLOP per token by the full-square count
    flops = bg.flops_per_token(cfg, 1024, cfg.padded_vocab(1), False)
    assert row.mfu_noncausal == pytest.approx(32194.0 * flops / 989e12) == pytest.approx(0.334, abs=0.001)
    assert row.mfu_causal < row.mfu_noncausal
    skipped = bg.Row(bg.Case("gpt2-1.5b", fp8="rowwise"), skipped="FP8 needs compute capability 8.9+")
    text = bg.table([row, skipped], "H100").splitlines()
    assert text[0].startswith("| case (H100) |") and len(text) == 4
    assert "| gpt2-1.5b compiled bf16 | 4 x 1024 | 32,194 | " in text[2] and "33.4%" in text[2]
    assert "skipped: FP8 needs compute capability 8.9+" in text[3]


def test_planner_picks_the_micro_batch():
    cfg = get_preset("llama3.2-3b")
    full, ckpt = (bg.planner_micro_batch(cfg, 2048, c, 80.0) for c in (False, True))
    assert 1 <= full < ckpt <= bg.MAX_MICRO_BATCH  # checkpointing frees room for more sequences
    assert bg.planner_micro_batch(cfg, 2048, False, 30.0) == 0  # 3.2B x 16 bytes of states alone
    # FP8 rows get their own: the FP8 linears keep no bf16 casts of the weights under autocast (6 GB here)
    assert bg.planner_micro_batch(cfg, 2048, False, 80.0, "tensorwise") > full


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2():
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", "--no-kernels"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "bench-gpu needs a CUDA GPU; this machine has none" in out.stderr
    assert out.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize("mode", ["checks", "bench"])
def test_the_prepared_gpu_script_refuses_without_a_gpu(tmp_path, mode):
    out = subprocess.run(["bash", "benchmarks/gpu_issue42.sh", mode, str(tmp_path / "out")], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 2 and "needs a CUDA GPU; this machine has none" in out.stderr, out
    assert "Traceback" not in out.stderr + out.stdout and not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_the_gpu_suite_refuses_without_a_gpu():
    """`make test-gpu`'s pytest line without a GPU: exit 2 and the reason, not a pass with every test skipped."""
    env = {**os.environ, "MEGAZOO_TEST_GPU": "1", "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-m",
                          "cuda or cuda_multi", "tests/gpu"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 2 and "make test-gpu needs a CUDA GPU; this machine has none" in out.stdout, out
    assert "Traceback" not in out.stdout + out.stderr


def test_the_fp8_rows_are_in_the_bench():
    names = [c.name for c in bg.cases()]
    for model in bg.MODELS:
        assert f"{model} compiled fp8-tensorwise" in names and f"{model} compiled fp8-rowwise" in names
    assert names.index("llama3.2-3b compiled fp8-tensorwise") < names.index("llama3.2-3b eager bf16")


def test_bad_model_is_refused():
    with pytest.raises(SystemExit) as err:
        bg.main(["--models", "gpt5"])
    assert err.value.code == 2
