"""The tiny recipe the dry-run tests run for real and on fake tensors (written per layout into a tmp folder)."""

from __future__ import annotations

TINY = """
[model]
preset = "gpt2-tiny"
n_layer = 4
vocab_size = 300
dropout = 0.0
attn_dropout = 0.0
[parallel]
dp = {dp}
tp = {tp}
pp = {pp}
[zero]
stage = {stage}
reduce_bucket_size = 20000
[train]
steps = 1
micro_batch = 2
grad_accum = {grad_accum}
seq_len = 32
precision = "{precision}"
{extra}
[data]
source = "synthetic"
synthetic_tokens = 20000
[logging]
progress = false
[sample]
tokens = 0
[run]
dir = "{run_dir}"
"""


def tiny_dry_recipe(tmp_path, *, dp=2, tp=1, pp=1, stage=0, extra="", precision="fp32", grad_accum=2):
    path = tmp_path / f"tiny-{dp}-{tp}-{pp}-{stage}-{precision}-{grad_accum}.toml"
    path.write_text(TINY.format(dp=dp, tp=tp, pp=pp, stage=stage, extra=extra, precision=precision,
                                grad_accum=grad_accum, run_dir=tmp_path / "run"))
    return path
