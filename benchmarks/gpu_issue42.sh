#!/usr/bin/env bash
# Issue 42's GPU checks, prepared on CPU for a session with one GPU (H100: ~3 + ~6 minutes of device time, two calls
# so that each stays under a 10-minute command limit). From the repository root, CUDA torch installed:
#   bash benchmarks/gpu_issue42.sh checks [OUT_DIR]   # cuda tests of the fused loss and FP8, fused-loss peak memory
#   bash benchmarks/gpu_issue42.sh bench  [OUT_DIR]   # make bench-gpu's table (5.5 min budget, no kernels table)
# bench's table has the FP8 rows (tensorwise and rowwise, compiled, Llama 3.2 3B first: bench_gpu.cases()).
# checks: tests/gpu/test_fp8_fused_loss_cuda.py (scaled_mm == emulation, FP8 training vs bf16 after 30 steps, the
#   fused loss exact in fp64 and lighter in bf16), then benchmarks/fused_loss.py at Llama 3.1 8B's vocabulary and
#   width (128,256 x 4096) with 8K tokens, plain vs fused. OUT_DIR (default runs/gpu-issue42) keeps every output.
# Without a CUDA GPU either mode says so and exits 2 before running anything; a failing step fails the script.
set -u -o pipefail
what=${1:-checks}
out=${2:-runs/gpu-issue42}
py=${PYTHON:-.venv/bin/python}
case "$what" in checks|bench) ;; *) echo "usage: $0 checks|bench [OUT_DIR]" >&2; exit 2 ;; esac
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_issue42.sh $what needs a CUDA GPU; this machine has none (torch.cuda.is_available() is False with" \
    "$py). Run it on a GPU machine with the CUDA torch wheel installed." >&2
  exit 2
fi
mkdir -p "$out"
case "$what" in
  checks)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    MEGAZOO_TEST_GPU=1 TRITON_INTERPRET=0 timeout 150 "$py" -m pytest -q -m cuda -p no:xdist \
      tests/gpu/test_fp8_fused_loss_cuda.py 2>&1 | tail -25 | tee "$out/tests.txt"
    timeout 60 "$py" benchmarks/fused_loss.py --tokens 8192 --d-model 4096 --vocab 128256 --dtype bf16 \
      --device cuda 2>&1 | tee "$out/fused_loss.txt" ;;
  bench)
    TRITON_INTERPRET=0 timeout 420 "$py" -m benchmarks.bench_gpu --budget-s 330 --no-kernels \
      --json "$out/bench-gpu.json" 2>&1 | tee "$out/bench-gpu.txt" ;;
  *) echo "usage: $0 checks|bench [OUT_DIR]" >&2; exit 2 ;;
esac
