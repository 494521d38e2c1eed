#!/usr/bin/env bash
# Run on a machine with an NVIDIA GPU: the engine tests with the compiled Triton
# kernels (the CUDA-only tests run instead of skipping), then the engine
# benchmark. Results land in ${OUT:-bench-out}/.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=${OUT:-bench-out}
mkdir -p "$DEST"

"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device (torch %s)" % torch.__version__)
print("CUDA device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
PYEOF

# Compiled kernels, not the interpreter: unset TRITON_INTERPRET. On this machine
# every LLM without an explicit device runs on CUDA with the Triton backend, so
# the whole engine suite exercises the CUDA path; -rs lists anything skipped.
env -u TRITON_INTERPRET "$PY" -m pytest tests/engine -q -rs 2>&1 | tee "$DEST/engine_gpu_tests.txt"

env -u TRITON_INTERPRET "$PY" benchmarks/engine_bench.py --preset gpu --device cuda \
    --out "$DEST/engine_gpu.json"
env -u TRITON_INTERPRET "$PY" benchmarks/engine_bench.py --preset gpu --device cuda --backend torch \
    --batch 16 --decode-tokens 32 --out "$DEST/engine_gpu_torch_backend.json"
