"""The loss bound of qgZ (and hpZ + qwZ + qgZ) on a short run: benchmarks/quantized_loss.py's function at dp 4 =
2 nodes x 2, a smaller gpt2-tiny (2 layers x 64) for 30 steps, fp32. qgZ int4 alone and with hpZ + qwZ (int8
errs less; its bound is held in tests/parallel/zero/test_qgz.py): the final loss stays within 1% of the unquantized ZeRO-3
run and differs from it (the quantization really ran); the masters stay fp32. The 300-step measurement is the
benchmark's (README, ZeRO across nodes)."""

from __future__ import annotations

from benchmarks.quantized_loss import measure

SMALL = {"n_layer": 2, "d_model": 64, "n_head": 2}
SHORT = {"micro_batch": 2, "seq_len": 32, "warmup_steps": 5, "eval_batches": 2}


def test_quantized_gradients_train_within_one_percent_of_unquantized():
    got = measure(30, ["zero3", "qgz-int4", "hpz+qwz+qgz-int4"], SMALL, SHORT)
    ref = got["zero3"]
    assert ref["final"] < ref["losses"][0] - 0.3  # it learned something, so the comparison means something
    for name in ("qgz-int4", "hpz+qwz+qgz-int4"):
        row = got[name]
        assert row["masters"] == ["torch.float32"]
        assert 0 < abs(row["final_rel"]) < 0.01, (name, row["final_rel"])
        assert 0 < abs(row["val_rel"]) < 0.01, (name, row["val_rel"])
