# Two set-up commands (see README): `make demo` runs the embedded default job, `make test` the test suite.
# Both create .venv on first use and install torch 2.13.0 (CPU wheel) first when torch is missing, then megazoo.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megazoo-installed

.PHONY: install demo moe-demo moe-dry-run deepseek-demo sft-demo test test-gpu bench-gpu clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/megazoo train recipes/demo.toml

# The mixture-of-experts demo (recipes/moe-demo.toml): 8 experts per layer split over 2 processes (ep 2).
moe-demo: install
	$(VENV)/bin/megazoo train recipes/moe-demo.toml

# Qwen3-235B-A22B's step at its full world size (1,024 ranks, all 94 layers) on fake tensors against the planner,
# MoE all-to-all bytes per link class included (too slow for CI; tests/recipes/planner/test_moe_dry_run.py runs a
# 2-layer Qwen3-30B-A3B at its full size). 16 micro-batches: 1F1B's peak is reached at pp of them.
moe-dry-run: install
	mkdir -p runs
	$(VENV)/bin/megazoo plan --recipe recipes/qwen3-235b-a22b.toml --dry-run --set train.grad_accum=16 \
		--set train.global_batch=128 --json runs/moe-dry-run-qwen3-235b.json

# The DeepSeek-V3-style demo (recipes/deepseek-demo.toml): sigmoid + bias routing over 8 experts at ep 2, one shared
# expert, the first layer dense, one multi-token prediction module; then the MTP module drafts for greedy decoding.
deepseek-demo: install
	$(VENV)/bin/megazoo train recipes/deepseek-demo.toml
	$(VENV)/bin/megazoo generate runs/deepseek-demo/checkpoints --prompt "def " --max-new-tokens 48 --speculative

# The fine-tuning demo (recipes/sft-demo.toml): LoRA on `make demo`'s model (trained first if it is missing), taught
# to answer a docstring with its signature through the ChatML template; prints the answers before and after.
sft-demo: install
	test -d runs/demo/checkpoints || $(VENV)/bin/megazoo train recipes/demo.toml
	$(VENV)/bin/megazoo data sft-demo --checkpoint runs/demo/checkpoints --output-prefix runs/sft-demo-data/sft/stdlib_sft --overwrite
	$(VENV)/bin/megazoo train recipes/sft-demo.toml

# Two pytest workers (pytest-xdist), one file at a time each: most of the suite is one busy process, so the
# second core would otherwise idle (the multi-process tests still share the two). Serial: `pytest -q -p no:xdist`.
test: install
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile

# The GPU suite (tests/gpu): on a CUDA machine, install the CUDA torch wheel first (README "On a GPU machine").
# MEGAZOO_TEST_GPU=1 keeps the GPUs visible to the tests; Triton runs compiled, never interpreted.
test-gpu: install
	MEGAZOO_TEST_GPU=1 TRITON_INTERPRET=0 $(PY) -m pytest -q --durations=15 -m "cuda or cuda_multi" tests/gpu

# One-GPU throughput / MFU / peak memory / loss table (benchmarks/bench_gpu.py, <= 8 minutes on an H100): gpt2-1.5b
# and Llama 3.2 1B / 3B, eager and compiled, bf16 and each FP8 recipe, with and without activation checkpointing;
# then benchmarks/kernels.py's per-op table. Without a suitable GPU it says so and exits 2.
bench-gpu: install
	TRITON_INTERPRET=0 $(PY) -m benchmarks.bench_gpu --json runs/bench-gpu.json

clean:
	rm -rf runs .pytest_cache
