#!/usr/bin/env bash
# GPU evidence for the H200 image (torch, triton, jax with CUDA; jax-triton carried as a
# wheel in .whl/ when the image lacks it), in parts that each fit one device call
# (600 s): `bash scripts/h200.sh PART` with PART one of
#   tests  the GPU tests but the launch-plan sweep, then the test that needs most of the
#          GPU's memory on its own
#   sweep-torch, sweep-jax  the launch-plan sweep (every plan the heuristics pick), one
#          framework at a time; `sweep` runs both. Neither fits one call: SWEEP_PART=I/N
#          runs the I-th of N interleaved parts (pytest --part). At 2026-12-02 PyTorch took
#          288 + 302 s in 2 parts on 8 workers, JAX 190+ + 194 s in 2 parts on 4 (10
#          PyTorch workers ran out of GPU memory twice); at 2026-12-05 PyTorch's part 1/2
#          reached 156 of its 246 ids in 250 s and JAX's whole sweep 55 of 56 in 395 s
#          (the last, bfloat16-262144-7, took 55 s alone): plan 3 parts for PyTorch
#          SWEEP_OPS=op,op sweeps only those ops (tests/gpu/test_launch_plan_sweep.py)
#   check  `ratiokl check` on the four backends (the conformance table)
#   bench  the headline benchmark (both timings, every provider) and its report
#   ab     a kernel change timed beside this tree: AB_TREE=DIR (a copy of another tree's
#          src/, carried to the device) and src/ take turns, AB_ROUNDS times (2), each a
#          suite run of AB_OPS with ratiokl and Liger; results ab_<1|2><tree>_<round>.json, packed
#          with their logs into ab.tgz (the device returns few files); AB_PROVIDERS picks
#          the providers (ratiokl-torch-triton,liger)
#   all    all four in turn (longer than one call)
# Logs and results go to ${OUT:-gpu-out} (draw plots anywhere with benchmarks/plot.py).
set -uo pipefail
part=${1:-all}
out=${OUT:-gpu-out}
mkdir -p "$out"
site=  # the carried wheels' folder, ahead of the source tree on PYTHONPATH
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  site=/tmp/site:
fi
export PYTHONPATH=${site}src
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# A fresh device machine once had no writable ~/.triton ("Could not create or locate cache
# dir"): Triton's cache goes under /tmp unless the caller chose a folder.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv \
  > "$out/gpu.csv" 2>&1
pytest_gpu() {  # verbosity is the caller's (-q with -v is the default verbosity: dots)
  python3 -m pytest -p no:cacheprovider -p no:benchmark "$@"
}
if [ "$part" = tests ] || [ "$part" = all ]; then
  # 4 workers: at 8 the JAX sweep ran out of GPU memory on the H200.
  { pytest_gpu -q -m "gpu and not whole_gpu" -n "${GPU_TEST_WORKERS:-4}" tests/gpu \
      --ignore=tests/gpu/test_launch_plan_sweep.py
    pytest_gpu -q -m "gpu and whole_gpu" tests/gpu
    # The fused kernel's registers and spills at the headline vocabulary (the default
    # gradient plan was 72 registers before the entropy sum joined pass 1).
    python3 -c "
import torch
from ratiokl.torch.loss import policy_loss
from ratiokl._kernels.fused_loss import policy_loss_kernel as k
x = torch.randn(64, 151936, device='cuda', dtype=torch.bfloat16, requires_grad=True)
ids = torch.randint(0, 151936, (64,), device='cuda')
old = torch.zeros(64, device='cuda')
for coef in (0.0, 0.01):
    policy_loss(x, None, ids, None, old, old + 1, entropy_coef=coef)[0].backward()
for d in k.device_caches.values():
    for c in d[0].values():
        print('policy_loss_kernel', c.n_regs, 'registers', c.n_spills, 'spills')
"; } 2>&1 | tee "$out/gpu_tests.log"
fi
# The sweep in parts (SWEEP_PART, above). `-v` names every result as it lands, so a cut
# run still says which ids passed; JAX on 4 workers (6 ran out of GPU memory: XLA's
# command buffers and autotuning beside torch's pool).
sweep_part=${SWEEP_PART:+--part=$SWEEP_PART}
if [ "$part" = sweep-torch ] || [ "$part" = sweep ] || [ "$part" = all ]; then
  PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
  pytest_gpu -v -m gpu -n "${GPU_TEST_WORKERS:-8}" -k test_torch_sweep $sweep_part \
    tests/gpu/test_launch_plan_sweep.py 2>&1 | tee "$out/gpu_sweep_torch.log" \
    | grep -E "FAILED|passed|failed"
fi
if [ "$part" = sweep-jax ] || [ "$part" = sweep ] || [ "$part" = all ]; then
  pytest_gpu -v -m gpu -n "${GPU_JAX_WORKERS:-4}" -k test_jax_sweep $sweep_part \
    tests/gpu/test_launch_plan_sweep.py 2>&1 | tee "$out/gpu_sweep_jax.log" \
    | grep -E "FAILED|passed|failed"
fi
if [ "$part" = check ] || [ "$part" = all ]; then
  python3 -m ratiokl check --no-progress --backend torch-native --backend torch-triton \
    --backend jax-native --backend jax-triton --json "$out/check.json" 2>&1 \
    | tee "$out/check.log"
fi
if [ "$part" = ab ]; then
  ab_ops=${AB_OPS:-policy_loss_ref_logps,policy_loss_ref_logps_entropy,selected_logprobs_entropy,selected_logprobs,ratio_kl_ref_logps}
  for round in $(seq "${AB_ROUNDS:-2}"); do
    side=0
    for tree in src "${AB_TREE:?set AB_TREE to the other src folder}"; do
      side=$((side + 1))  # in the tag too: AB_TREE=src (the tree against itself) keeps both
      tag=${side}${tree//\//_}_$round
      PYTHONPATH=$site$tree timeout 200 python3 benchmarks/run.py \
        --preset headline --providers "${AB_PROVIDERS:-ratiokl-torch-triton,liger}" --ops "$ab_ops" \
        --out "$out/ab_$tag.json" > "$out/ab_$tag.log" 2>&1
      echo "ab $tag rc=$?"
    done
  done
  (cd "$out" && tar czf ab.tgz ab_* && rm -f ab_*)
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
  timeout "${BENCH_TIMEOUT:-560}" python3 benchmarks/run.py --preset headline \
    --out "$out/h200.json" 2>&1 | tee "$out/bench.log"
  python3 benchmarks/report.py "$out/h200.json" --markdown > "$out/report.md" 2>&1
fi
