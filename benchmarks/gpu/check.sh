#!/usr/bin/env bash
# The GPU check for a lent device, at most 5 minutes: the GPU path's tests, compiled on CUDA tensors
# (the files that import nothing of the server: the device has torch, triton and transformers only),
# with compute-sanitizer's memcheck over two attention cases where it is installed (45 s at most),
# then check.py (correctness against the CPU reference, eager and through CUDA graphs; decode against
# the HBM roofline; TTFT; 2:4 against dense), JSON to $OUT. DRY_RUN=1 runs check.py on the CPU under Triton's interpreter (tiny
# shapes, no timing). Run from the repository root.
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:-}:."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ "${DRY_RUN:-0}" = "1" ]; then PY=.venv/bin/python; fi
if [ "${DRY_RUN:-0}" != "1" ]; then
  OUT="${OUT:-benchmarks/results}"
  mkdir -p "$OUT"
  if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 90 "$PY" -m pytest -q -rA -m "gpu or not slow" -p no:cacheprovider tests/layers/test_triton_attention.py \
      tests/runner/test_cuda_graphs.py tests/layers/test_sampler.py tests/quant/test_sparse24.py 2>&1 | tee "$OUT/gpu_tests.txt" \
      || echo "gpu tests failed"
    if command -v compute-sanitizer >/dev/null; then  # races and out-of-bounds reads the interpreter hides
      timeout 45 compute-sanitizer --tool memcheck --error-exitcode 3 "$PY" -m pytest -q -x -p no:cacheprovider \
        tests/layers/test_triton_attention.py -k "query_lens0 or query_lens5" 2>&1 | tail -20 | tee "$OUT/memcheck.txt" \
        || echo "memcheck: errors or out of time (see memcheck.txt)"
    fi
  else
    echo "pytest is not installed here: the gpu tests are skipped" | tee "$OUT/gpu_tests.txt"
  fi
fi
timeout 150 "$PY" benchmarks/gpu/check.py  # (90 + 45 + 150 s: inside 5 minutes)
