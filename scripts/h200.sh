#!/usr/bin/env bash
# GPU evidence in one go, for the H200 image (torch, triton, jax with CUDA; jax-triton
# carried as a wheel in .whl/ when the image lacks it). Writes logs and results to
# ${OUT:-gpu-out}: the conformance table, the GPU test log and the headline benchmark
# (draw its plots anywhere with benchmarks/plot.py).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:src
else
  export PYTHONPATH=src
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -m ratiokl check --backend torch-native --backend torch-triton --backend jax-native \
  --backend jax-triton --json "$out/check.json"; } 2>&1 | tee "$out/check.log"
# The launch-plan sweep included (4 workers: at 8 the JAX sweep ran out of GPU memory);
# tests that need most of the GPU's memory run alone after.
{ python3 -m pytest -q -m "gpu and not whole_gpu" -n "${GPU_TEST_WORKERS:-4}" tests/gpu \
    -p no:cacheprovider -p no:benchmark
  python3 -m pytest -q -m "gpu and whole_gpu" tests/gpu -p no:cacheprovider -p no:benchmark; } \
  2>&1 | tee "$out/gpu_tests.log"
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-600}" python3 benchmarks/run.py --preset headline \
    --out "$out/h200.json" 2>&1 | tee "$out/bench.log"
  python3 benchmarks/report.py "$out/h200.json" --markdown > "$out/report.md" 2>&1
fi
