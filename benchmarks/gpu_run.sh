#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels (.whl/, see README.md) and this
# package (for its entry points), then run what is named: tests, attention, e2e, decode.
# Logs and JSON go to $OUT.   Usage: bash benchmarks/gpu_run.sh tests attention
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
    attention) python3 benchmarks/attention.py --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" ;;
    e2e) python3 benchmarks/e2e.py --out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" ;;
    decode) python3 benchmarks/decode.py --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
