#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels (.whl/, see README.md) and this
# package (for its entry points), then run what is named: tests (or tests-kernels,
# tests-kvcache, tests-compile), attention, e2e, decode.
# Logs and JSON go to $OUT.   Usage: bash benchmarks/gpu_run.sh tests attention
# The whole GPU suite (`tests`, ~190 tests) takes over 11 minutes on the H100,
# more than one 10-minute device call: split it as `tests-kernels` (~4.5 min), then
# `tests-kvcache tests-compile`.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site .whl/*.whl . \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
for step in "$@"; do
  case "$step" in
    tests) python3 -m pytest -m gpu -q -rs 2>&1 | tee "$OUT/gpu_tests.log" ;;
    tests-kernels) python3 -m pytest -m gpu -q -rs tests/test_kernels_gpu.py tests/test_hopper_gpu.py 2>&1 | tee "$OUT/gpu_tests_kernels.log" ;;
    tests-kvcache) python3 -m pytest -m gpu -q -rs tests/test_kvcache_gpu.py 2>&1 | tee "$OUT/gpu_tests_kvcache.log" ;;
    tests-compile) python3 -m pytest -m gpu -q -rs tests/test_lowering_gpu.py tests/test_zoo.py 2>&1 | tee "$OUT/gpu_tests_compile.log" ;;
    attention) python3 benchmarks/attention.py --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" ;;
    e2e) python3 benchmarks/e2e.py --out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" ;;
    decode) python3 benchmarks/decode.py --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
