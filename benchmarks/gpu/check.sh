#!/usr/bin/env bash
# The GPU check for a lent device, at most 5 minutes: the gpu-marked tests, then check.py (correctness
# against the CPU reference, decode against the HBM roofline, TTFT), JSON to $OUT. DRY_RUN=1 runs the
# same on the CPU under Triton's interpreter (tiny shapes, no timing). Run from the repository root.
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:-}:."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ "${DRY_RUN:-0}" = "1" ]; then PY=.venv/bin/python; fi
if [ "${DRY_RUN:-0}" != "1" ]; then
  timeout 120 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider || echo "gpu tests failed (see above)"
fi
timeout 240 "$PY" benchmarks/gpu/check.py
