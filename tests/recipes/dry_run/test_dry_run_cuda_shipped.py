"""Every shipped recipe's step on fake CUDA (default kernels: `auto` as on a GPU, Triton ops included) next to
its CPU dry run: the same collectives op by op, FLOPs within 2% of the CPU run's, a peak no more than the
planner's tolerance (10%) over the CPU run's (the CPU's `auto` kernels hold more: see the test), the CUDA-only
calls listed as stubbed.

Budget: one fresh interpreter (recipes/dry_run/cuda.run_jobs with "also_cpu") runs both dry runs of every
recipe, so the shim's start-up and the imports are paid once. Each recipe is shrunk where the per-layer figures
do not change (tests/recipes/planner/test_dry_run.py runs the full-size CPU dry runs against the planner):
  * model.n_layer: one block per pipeline (virtual) stage, at least 2 - every block of a recipe is the same
    block, so its bytes, collectives and FLOPs are the same per block at any depth;
  * train.grad_accum: at most max(pp, 1) micro-batches, as the full-size test does for pipelines;
  * train.precision "auto" pinned to bf16 (what it is on CUDA; the CPU dry run's "auto" is fp32);
  * fine-tuning recipes: the model from their preset instead of their checkpoint (not on this machine, or
    left by `make demo`: the test must not depend on it).
The widths, heads, vocabulary, sequence length, micro-batch, world size, ZeRO stage and offload are the recipe's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megazoo.recipes.config import load_recipe
from megazoo.recipes.dry_run.run import load
from megazoo.recipes.dry_run.cuda import run_jobs

REPO = Path(__file__).resolve().parents[3]
# The two 405B recipes (16,384 ranks, 16 stages) ran 57 s and 93 s alone here, but their fake-CUDA run made this
# file's fixture take 32 minutes inside a loaded two-worker suite: they are dry-run by hand, not in CI.
# deepseek-v3 (2,048 ranks) and kimi-k2 (256): dry-run on fake CUDA at reduced depth against the planner in
# tests/recipes/planner/test_deepseek_dry_run.py
BY_HAND = {"llama3.1-405b", "llama3.1-405b-128k", "llama-405b-full-ft", "deepseek-v3", "kimi-k2",
           # the MoE recipes: their CPU dry run is tests/recipes/planner/test_moe_dry_run.py; moe-demo and
           # deepseek-demo run the same MoE step on fake CUDA here
           "qwen3-30b-a3b-full-ft", "qwen3-30b-a3b-lora", "mixtral-8x7b-ft", "qwen3-235b-a22b",
           "mixtral-8x22b"}
SHIPPED = sorted(p.stem for p in (REPO / "recipes").glob("*.toml") if p.stem not in BY_HAND)


def shrunk(name: str) -> list[str]:
    """The `--set` overrides of the module docstring for shipped recipe `name`."""
    path = REPO / "recipes" / f"{name}.toml"
    sets = []
    if load_recipe(path).model.from_checkpoint:  # whether or not `make demo` left its checkpoint in this checkout
        sets = ['checkpoint.load=""', "model.from_checkpoint=false"]
    res = load(path, sets)
    par, train = res.recipe.parallel, res.recipe.train
    accum = min(train.grad_accum, max(par.pp, 1))
    sets += [f"model.n_layer={max(par.pp * par.virtual_stages, 2)}", f"train.grad_accum={accum}",
             f"train.global_batch={train.micro_batch * accum * par.dp}"]
    if par.layers:
        sets.append("parallel.layers=[]")
    if train.precision == "auto":
        sets.append("train.precision=bf16")
    return sets


@pytest.fixture(scope="module")
def reports():
    jobs = [{"recipe": str(REPO / "recipes" / f"{n}.toml"), "sets": shrunk(n), "gpu_memory_gb": 80,
             "also_cpu": True} for n in SHIPPED]
    out = dict(zip(SHIPPED, run_jobs(jobs)))
    for name, rep in out.items():  # the per-recipe table and its CI cost (shown with -s)
        if "error" in rep:
            continue
        peak = lambda r: max(role["measured_peak_bytes"] for role in r["roles"]) / 1e6  # noqa: E731
        print(f"{name}: peak fake CUDA {peak(rep):,.1f} MB, CPU {peak(rep['cpu']):,.1f} MB "
              f"({peak(rep) / peak(rep['cpu']):.3f}); dp bytes {sum(r['dp_ring_bytes'] for r in rep['roles']):,.0f}; "
              f"{rep.get('process_seconds', 0):.1f} s CPU for both dry runs")
    return out


# gpt-100b (fp16, activation checkpointing, tp 16, ZeRO-2) was 15.7% over its CPU dry run here (1,484,845,056 vs
# 1,283,336,504 B, all of it backward temporaries): CUDA autocast ran torch's LayerNorm in fp32, so each recomputed
# block held fp32 copies of its LayerNorm inputs and fp32 gradients. A 16-bit input now runs outside autocast
# (kernels/layer_norm.py layer_norm_outside_autocast), as on the CPU.


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_on_fake_cuda_matches_its_cpu_dry_run(reports, name):
    cuda = reports[name]
    assert "error" not in cuda, cuda.get("error")
    cpu = cuda["cpu"]
    assert cuda["device"].startswith("cuda") and cuda["world_size"] == cpu["world_size"]
    for fake, host in zip(cuda["roles"], cpu["roles"], strict=True):
        assert fake["rank"] == host["rank"]
        assert fake["collectives"] == host["collectives"], name
        assert fake["dp_ring_bytes"] == host["dp_ring_bytes"]
        # The same work: FLOPs within 2% of the CPU dry run's (their agreement with the formula is
        # tests/recipes/planner/test_dry_run.py's; the formula does not model LoRA's frozen weights, sft-demo counts 72% of it).
        assert abs(fake["flops"] - host["flops"]) <= 0.02 * host["flops"]
        # Peaks: `auto` is not the same kernel set on both devices - on CUDA the cross-entropy is Triton, which
        # keeps three fp32 numbers per row; on the CPU it is torch's chunked one, whose fp32 chunk of the logits
        # (up to 2**24 elements) is a transient the GPU never holds (demo: 37.9 MB on fake CUDA vs 60.5 MB; with
        # kernels.cross_entropy = "torch" on both, 61.8 vs 60.5 MB, +2.2%). So the CPU dry run is an upper bound.
        assert fake["measured_peak_bytes"] <= 1.10 * host["measured_peak_bytes"], \
            (name, fake["measured_peak_bytes"], host["measured_peak_bytes"], fake["by_category"], host["by_category"])
    stubbed = {row["call"] for row in cuda["not_executed"]}
    assert {"get_rng_state", "reset_peak_memory_stats"} <= stubbed, stubbed
